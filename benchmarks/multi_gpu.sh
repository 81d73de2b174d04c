#!/usr/bin/env bash
# Issue 24's multi-GPU runs in one device call (docs/benchmarks/multi_gpu.md). Run from the
# repo root on a 2/4/8-GPU machine, with the wheel bundle carried in .whl/ (built here by
# scripts/device_bundle.sh):
#
#   bash benchmarks/multi_gpu.sh correctness tp2-dense dcp2 [tp-scaling] [long-context]
#
# Sections:
#   correctness   the gpu tests of TP/DCP (NCCL groups, the Ray executor on CUDA)
#   tp2-dense     Qwen3-8B shape, batch-1 latency and offline throughput at TP 1 and 2
#   dcp2          Qwen3-8B shape, batch-1 latency at DCP 2 (beside tp2-dense's DCP 1)
#   tp-scaling    Qwen3-32B shape, latency and throughput at TP 2/4/8 (as many as there
#                 are GPUs)
#   long-context  Qwen3-8B shape, decode after CONTEXT_LEN tokens (default 32768) at
#                 DCP 1/2/4 (as many as there are GPUs)
#
# Results land in $OUT (one JSON per run, logs); RESULT lines go to stdout. STEPS sets the
# latency runs' decode steps (default 511), CONTEXT_LEN the long-context prompt, and
# BENCH_ARGS adds options to every bench (e.g. "--num-requests 200" for a shorter run).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/kvsite .whl/*.whl || exit 1
export PYTHONPATH=/tmp/kvsite:$PWD GRPC_VERBOSITY=ERROR RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
# Issue 24 measures the grid with CUDA graphs on (the switch reaches the Ray workers
# through their runtime_env); KVLOOM_MULTI_RANK_CUDA_GRAPHS=0 runs the grid eagerly.
export KVLOOM_MULTI_RANK_CUDA_GRAPHS=${KVLOOM_MULTI_RANK_CUDA_GRAPHS:-1}
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv
GPUS=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
echo "RESULT gpus $GPUS"
STEPS=${STEPS:-511}
CONTEXT_LEN=${CONTEXT_LEN:-32768}
# The gpu tests of TP and DCP: NCCL process groups and all-gather-v on 2 GPUs, the Ray
# executor's CUDA workers, a remote drafter on its own GPU.
GRID_TESTS="tests/test_distributed_process_group.py tests/test_distributed_all_gatherv.py
  tests/test_ray_gpu.py tests/test_remote_drafter.py"
status=0

# bench KIND SHAPE TP DCP NAME [ARGS...]: one `kvloom bench` run, JSON in $OUT/NAME.json.
bench() {
  local kind=$1 shape=$2 tp=$3 dcp=$4 name=$5
  shift 5
  local steps=()
  [ "$kind" = latency ] && steps=(--steps "$STEPS")
  if [ $((tp * dcp)) -gt "$GPUS" ]; then
    echo "RESULT skipped $name (needs $((tp * dcp)) GPUs, found $GPUS)"
    return 0
  fi
  python3 -m kvloom.cluster.cli bench "$kind" --shape "$shape" --tp "$tp" --dcp "$dcp" \
    "${steps[@]}" ${BENCH_ARGS:-} "$@" --out "$OUT/$name.json" 2>&1 \
    | tee "$OUT/$name.log" | grep -v "it/s" | tail -20
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "RESULT failed $name"; status=1; }
}

for section in "$@"; do
  case $section in
    correctness)
      python3 -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-$GRID_TESTS} \
        2>&1 | tee "$OUT/multi_gpu_tests.log" | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      ;;
    tp2-dense)
      for tp in 1 2; do
        bench latency qwen3-8b $tp 1 "qwen3-8b_latency_tp$tp"
        bench throughput qwen3-8b $tp 1 "qwen3-8b_throughput_tp$tp"
      done
      ;;
    dcp2)
      bench latency qwen3-8b 1 2 "qwen3-8b_latency_dcp2"
      ;;
    tp-scaling)
      for tp in 2 4 8; do
        bench latency qwen3-32b $tp 1 "qwen3-32b_latency_tp$tp"
        bench throughput qwen3-32b $tp 1 "qwen3-32b_throughput_tp$tp"
      done
      ;;
    long-context)
      for dcp in 1 2 4; do
        bench latency qwen3-8b 1 $dcp "qwen3-8b_latency_ctx${CONTEXT_LEN}_dcp$dcp" \
          --context-len "$CONTEXT_LEN" --max-model-len $((CONTEXT_LEN + STEPS + 1))
      done
      ;;
    *)
      echo "unknown section $section" >&2
      status=1
      ;;
  esac
done
exit $status
