#!/usr/bin/env bash
# The one script the GPU machine runs:  bash benchmarks/device.sh [stage ...]   (default: kernels bench)
# Installs the wheels carried in .whl/ (run(carry=[".whl"])), records the environment, then runs each stage.
# Logs and JSON go flat under $OUT (the device tool returns at most 8 files). Add a stage: define stage_NAME.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

setup() {
  if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || echo "wheel install failed" >&2
    export PYTHONPATH=/tmp/site:$PWD
  else
    export PYTHONPATH=$PWD
  fi
  { nvidia-smi; python3 -c 'import sys, torch, triton; print(sys.version); print("torch", torch.__version__,
    "cuda", torch.version.cuda, "gpus", torch.cuda.device_count()); print("triton", triton.__version__)'
    python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>&1 | tail -1; } >"$OUT/env.txt" 2>&1
  cat "$OUT/env.txt"
}

# per-stage time limits (s) keep one slow stage from starving the next inside the device call's limit
stage_kernels() { timeout "${T_KERNELS:-300}" python3 -m pytest -q -p no:cacheprovider tests/gpu 2>&1 | tee "$OUT/kernels.log"; }
stage_bench() {
  timeout "${T_BENCH:-400}" python3 benchmarks/bench_ops.py "$OUT/bench_ops.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench_ops.log"
}
# DCP (issue 4): torchrun n = 1, 2, 4 (those that fit the GPUs here), then one merged dcp.json + dcp.md table.
# DCP_NS picks the group sizes (default "1 2 4"), DCP_ARGS e.g. "--quick --no-compile", T_DCP limits each torchrun (s).
# Merge dcp.json files of separate calls later: python benchmarks/dcp_gpu.py --summarize all.json a/dcp.json b/dcp.json
stage_dcp() {
  local ngpu n rc=0 runs=() tmp=/tmp/dcp_runs
  ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  mkdir -p "$tmp"
  for n in ${DCP_NS:-1 2 4}; do
    [ "$n" -le "$ngpu" ] || continue
    echo "--- dcp n=$n" | tee -a "$OUT/dcp.log"
    timeout "${T_DCP:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
      benchmarks/dcp_gpu.py "$tmp/dcp_n$n.json" ${DCP_ARGS:-} 2>&1 | tee -a "$OUT/dcp.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "dcp n=$n FAILED" | tee -a "$OUT/dcp.log"; rc=1; }
    [ -f "$tmp/dcp_n$n.json" ] && runs+=("$tmp/dcp_n$n.json")
  done
  python3 benchmarks/dcp_gpu.py --summarize "$OUT/dcp.json" "${runs[@]}" 2>&1 | tee -a "$OUT/dcp.log"
  return $rc
}

# DSA (issue 6): mixed-batch indexer + dual graphs under CUDA-graph trees, then dense vs sparse benchmark
stage_dsa() {
  timeout "${T_DSA_TEST:-240}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_cudagraphs.py \
    tests/test_dsa_mixed_batch.py 2>&1 | tee "$OUT/dsa.log"
  timeout "${T_DSA_BENCH:-240}" python3 benchmarks/dsa_gpu.py "$OUT/dsa.json" 2>&1 | tee -a "$OUT/dsa.log"
}

setup
rc=0
for stage in "${@:-kernels bench}"; do
  for s in $stage; do
    echo "=== stage $s ($(date +%T))"
    "stage_$s" || rc=1
  done
done
exit $rc
