#!/usr/bin/env bash
# Wheels the H200 image lacks, for device-tool calls (run here, from the checkout root):
#   .whl/       everything kvloom imports: ../shared/tools/device-wheels.sh (Ray, pyzmq,
#               jsonschema, fla-core, einops) plus kvloom's other runtime dependencies,
#               pinned where the image's packages demand it (grpcio 1.84.0 there:
#               grpcio-health-checking/-reflection must not be newer). About 55 MB.
#   .whl-slim/  what the in-process engine, `kvloom bench` and the engine tests import
#               (no Ray, HTTP door or grammars): about 5 MB, small enough to carry beside
#               the vLLM peer kit's 46 MB in one call.
# In a call: carry [".whl"] (or [".whl-slim"]) and start the command with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/kvsite .whl/*.whl && export PYTHONPATH=/tmp/kvsite:$PWD
# The 2026-12-02 session spent four calls finding the packages listed here one by one.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
bash ../shared/tools/device-wheels.sh fla-core==0.6.0 einops
plat=(--only-binary=:all: --no-deps --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64)
slim=(msgspec xxhash tiktoken regex psutil)
python3 -m pip download -q "${plat[@]}" -d .whl "${slim[@]}" \
  "grpcio-health-checking==1.84.0" "grpcio-reflection==1.84.0" \
  "xgrammar>=0.2,<0.3" apache-tvm-ffi pydantic pydantic-core annotated-types \
  typing-inspection fastapi starlette anyio sniffio h11 uvicorn click annotated-doc \
  opentelemetry-api importlib-metadata zipp
grep -qx '/.whl-slim/' .git/info/exclude || echo '/.whl-slim/' >> .git/info/exclude
rm -rf .whl-slim && mkdir .whl-slim
for name in msgspec xxhash pyzmq fla_core einops tiktoken regex psutil; do
  cp .whl/"$name"-*.whl .whl-slim/
done
du -sh .whl .whl-slim
