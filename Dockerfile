# syntax=docker/dockerfile:1
# kvloom serving image: a CUDA base image, Python 3.12, torch, then kvloom itself (`pip install .`).
# Every pod of the Helm chart runs it: the Ray head, the Ray GPU workers, the `kvloom serve`
# container and the model-download job, so Ray and kvloom versions match across the cluster.
#
#   docker build -t ghcr.io/kvloom/kvloom:0.1.0 .
#   # a torch build for another CUDA line, from PyTorch's wheel index:
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130 -t ... .
#
# torch's Linux wheels carry their own CUDA libraries (as pip packages), so the base image
# mainly provides the NVIDIA container-runtime settings; the host driver must support the
# CUDA version of the torch build.
#
# Needs BuildKit (the default builder since Docker 23) for the source bind mount below.

ARG CUDA_IMAGE=nvidia/cuda:12.8.1-base-ubuntu24.04
FROM ${CUDA_IMAGE}

ARG TORCH_VERSION=2.11.0
# Empty: PyPI, whose Linux x86_64 torch wheels are CUDA builds.
ARG TORCH_INDEX_URL=
ARG KVLOOM_UID=1000
ARG KVLOOM_GID=1000

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

# Python 3.12 is Ubuntu 24.04's own. gcc and the Python headers are for Triton, which compiles
# a small launcher module on first use; wget is what KubeRay's injected Ray probes call;
# procps gives `ray stop` its process tools.
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3.12 python3.12-venv python3.12-dev gcc libc6-dev \
      wget ca-certificates procps \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv "$VIRTUAL_ENV" \
 && echo 'export PATH=/opt/venv/bin:$PATH' > /etc/profile.d/kvloom-venv.sh

# torch first, pinned, in its own layer: the package only asks for `torch>=2.11`, so this
# fixes the version and CUDA build, and the heavy layer stays cached while the source changes.
RUN pip install "torch==${TORCH_VERSION}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}

# Then the package. The source is bind-mounted, not copied, so it never sits in the image
# (a ./kvloom folder on sys.path would shadow the installed package).
RUN --mount=type=bind,target=/tmp/kvloom-src,rw \
    cd /tmp/kvloom-src && pip install .

# A non-root user with a fixed numeric id: the chart's podSecurityContext runs as 1000:1000
# with runAsNonRoot. Ubuntu 24.04 images ship a user "ubuntu" holding uid 1000.
RUN (userdel --remove ubuntu 2>/dev/null || true) \
 && groupadd --gid "${KVLOOM_GID}" kvloom \
 && useradd --uid "${KVLOOM_UID}" --gid "${KVLOOM_GID}" --create-home --shell /bin/bash kvloom
USER ${KVLOOM_UID}:${KVLOOM_GID}
WORKDIR /home/kvloom
ENV HOME=/home/kvloom

# `kvloom serve` listens on 127.0.0.1 unless told otherwise; in a container that is
# unreachable from outside, so the image listens on every interface (--host overrides).
ENV KVLOOM_HOST=0.0.0.0
EXPOSE 50051 9090
ENTRYPOINT ["kvloom"]
CMD ["--help"]
