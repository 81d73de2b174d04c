#!/usr/bin/env bash
# Creates .venv and installs kvloom with its test tools. torch goes first: a plain `torch`
# requirement with no torch installed would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q "torch==${KVLOOM_TORCH_VERSION:-2.13.0}"
python -m pip install -q -e ".[test]"
echo "kvloom installed in $(pwd)/.venv"
