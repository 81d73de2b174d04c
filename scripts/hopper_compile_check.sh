#!/usr/bin/env bash
# Builds every Triton kernel the CPU kernel tests launch, and the kernel benchmarks' real
# shapes, for a Hopper GPU (sm_90) on a machine without one (tests/hopper_compile.py):
# Triton's compiler and ptxas, nothing launched. Exits non-zero if any kernel fails to
# build or exceeds Hopper's limits. Run it before a GPU lease, after kernel changes.
#
#   bash scripts/hopper_compile_check.sh                      # the venv's Triton
#   TRITON_VERSION=3.6.0 bash scripts/hopper_compile_check.sh # the GPU machines' Triton
#   bash scripts/hopper_compile_check.sh tests/test_gemv.py   # only these tests
#
# The tests' numeric assertions fail in this mode (nothing runs); only the build lines
# (HOPPER BUILD, BUILD FAILED) mean anything. Reports: $OUT (default /tmp/hopper_compile).
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
OUT=${OUT:-/tmp/hopper_compile}
mkdir -p "$OUT"
if [ -n "${TRITON_VERSION:-}" ]; then
  site=${TMPDIR:-/tmp}/kvloom-triton-$TRITON_VERSION
  if [ ! -d "$site/triton" ]; then
    python -m pip install -q --no-deps --target "$site" "triton==$TRITON_VERSION" || exit 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
if [ $# -gt 0 ]; then
  tests=("$@")
  benches=()
else
  # Kernel test files: every module under tests/ that launches a Triton kernel directly.
  mapfile -t tests < <(grep -l "_triton\b\|_triton(" tests/test_*.py | sort)
  tests+=(tests/triton_interpret)
  benches=(
    "benchmarks/norm_gemv_fusion.py"
    "benchmarks/gemv_silu_fusion.py"
    "benchmarks/attention_launch_fusion.py"
  )
fi
KVLOOM_HOPPER_COMPILE_REPORT="$OUT/tests.json" python -m pytest -p tests.hopper_compile -q \
  --tb=no -p no:cacheprovider -m "not slow" \
  --deselect tests/triton_interpret/test_kernels_triton_fresh_process.py \
  --deselect tests/test_hopper_compile.py "${tests[@]}" > "$OUT/tests.log" 2>&1
grep -A40 "^HOPPER BUILD" "$OUT/tests.log" | grep -E "^(HOPPER|BUILD|SPILLS|    )" || {
  echo "no build summary: see $OUT/tests.log" >&2
  status=1
}
grep -q "^HOPPER BUILD .* 0 failures" "$OUT/tests.log" || status=1
for bench in "${benches[@]}"; do
  name=$(basename "$bench" .py)
  python -m tests.hopper_compile "$bench" > "$OUT/$name.log" 2>&1 || status=1
  echo "$bench: $(grep -E "^(HOPPER BUILD|SCRIPT FAILED)" "$OUT/$name.log" | tr '\n' ' ')"
  grep -E -A3 "^(BUILD FAILED|SPILLS)" "$OUT/$name.log"
done
exit $status
