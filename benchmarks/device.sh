#!/usr/bin/env bash
# The one script the GPU machine runs:  bash benchmarks/device.sh [stage ...]   (default: kernels bench)
#   stages: kernels (GPU tests)  bench (op benchmark)  sweep (decode configs)  linear (few-token GEMM configs)
#           wgmma (the Gluon many-head decode kernel, phase by phase)
#           profile (HF step)  host (per-call host time)  fp8 (FP8 cache decode)  dcp  dsa  hf
#           generate (HF generate() end to end)  genab (generate() here and at .base)  gencrash (lab probe)  compile
#           families (five HF MLA families at 32K)  select (indexer top-k)  report
#           fp8swap (lab probe: a swap-AB Gluon kernel for the FP8 cache at few heads, beside mla.decode / FlashMLA)
#           eagersplits (lab probe: split counts for eager decode calls)
#           swapab (lab probe: the few-head swap-AB Gluon decode over a bf16 cache, beside auto's kernel and the peers)
#           linearsum (lab bench: split-K fused_linear summed in its split launch vs a second launch)
#           decodemerge (lab bench: split-KV decode merged in its stage-1 launch vs a second launch)
#           seesaw (lab probe: the many-head seesaw kernel with 32-token tiles in two slot sets, beside the peers)
#           partials (lab probe: split-KV partial outs in bf16 vs float32, beside the peers)
#           cb (HF continuous batching, generate_batch, with and without mla_dcp)
# Installs the wheels carried in .whl/ (tools/device_wheels.sh fetches them; run(carry=[".whl"])), or in $WHEELS, records
# the environment, then runs each stage.
#
# $OUT stays flat and small (the device tool returns at most 8 files). A full run
#   bash benchmarks/device.sh kernels bench dcp dsa hf compile
# leaves at most 7:  run.log (environment + every stage's output)  bench_ops.json  dcp.json  dsa.json  hf.json
#                    compile.json  report.md (the generated RESULTS.md blocks, from the JSON files above)
# Intermediate files (per-n DCP runs, the DCP markdown) stay in /tmp. Add a stage: define stage_NAME; it may
# write at most one new file into $OUT, and must print to stdout (all output lands in run.log).
# The report step runs after the stages unless NO_REPORT=1; KIND=<device kind> labels it. Locally, turn a
# call's files into RESULTS.md tables + plots:  python -m benchmarks report <files_at> --kind ... --command ...
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/.device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ARGS="${*:-kernels bench}"

setup() {
  local wheels=${WHEELS:-.whl}  # WHEELS=.whl-latest: the newest transformers' set (tools/device_wheels.sh latest)
  if compgen -G "$wheels/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
      || echo "wheel install failed" >&2
  fi
  export PYTHONPATH=/tmp/site:$PWD
  # register the package (the mla_dcp entry point) without touching the image's torch/triton
  python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . || echo "editable install failed" >&2
  if ! python3 -c 'import torch; assert "mla_dcp" in torch._dynamo.list_backends()' 2>/dev/null; then
    echo "editable install did not register mla_dcp: writing its entry point by hand" >&2
    local d=/tmp/site/mla_compile-0.1.0.dist-info
    mkdir -p "$d"
    printf 'Metadata-Version: 2.1\nName: mla-compile\nVersion: 0.1.0\n' >"$d/METADATA"
    printf '[torch_dynamo_backends]\nmla_dcp = mla_compile.backend:mla_dcp\n' >"$d/entry_points.txt"
  fi
  echo "=== environment ($(date -u +%FT%TZ)): bash benchmarks/device.sh $ARGS"
  nvidia-smi
  python3 -c 'import sys, torch, triton; print(sys.version); print("torch", torch.__version__,
    "cuda", torch.version.cuda, "gpus", torch.cuda.device_count()); print("triton", triton.__version__)'
  python3 -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>&1 | tail -1
  python3 -c 'import transformers; print("transformers", transformers.__version__)' 2>&1 | tail -1
}

# per-stage time limits (s) keep one slow stage from starving the next inside the device call's limit
# the whole GPU suite (174 tests) takes ~290 s on an H200 (session 9 call 4): T_KERNELS defaults above that
# KERNELS_K: a pytest -k expression (may hold spaces), KERNELS_ARGS: more pytest arguments (the runs pass -q: -vv names
# each test as it ends, which tells where a shard the limit cut stopped; -v only cancels -q), KERNELS_ENV: NAME=value
# pairs for the tests only (e.g. MLA_COMPILE_PDL=1)
# KERNELS_FILES: the test files to run (default every tests/gpu/test_*.py), e.g. to finish shards a limit cut
# KERNELS_SHARDS=N: N pytest processes side by side on the one GPU (correctness tests only: nothing in tests/gpu
# times itself), each shard's output in run.log after it ends. The collected tests are dealt in N runs of
# consecutive node ids (a test's parametrizations stay together, sharing compiled kernels; whole files were
# unbalanced: one file could hold 140 tests, another 6). On the H100 host six shards ran ~55 tests each in 230-330 s.
# KERNELS_SKIP=M: leave out the first M collected tests (a call that finishes what a limit cut)
stage_kernels() {
  local n=${KERNELS_SHARDS:-1}
  if [ "$n" -le 1 ]; then
    env ${KERNELS_ENV:-} timeout "${T_KERNELS:-420}" python3 -m pytest -q -p no:cacheprovider ${KERNELS_FILES:-tests/gpu} ${KERNELS_K:+-k "$KERNELS_K"} ${KERNELS_ARGS:-}
    return
  fi
  local ids=() i rc=0 pids=() shards=()
  mapfile -t ids < <(python3 -m pytest --collect-only -q -p no:cacheprovider ${KERNELS_FILES:-tests/gpu} \
    ${KERNELS_K:+-k "$KERNELS_K"} 2>/dev/null | grep '::' | tail -n +"$((${KERNELS_SKIP:-0} + 1))")
  echo "--- kernels: ${#ids[@]} tests in $n shards"
  for ((i = 0; i < n; i++)); do
    local lo=$((i * ${#ids[@]} / n)) hi=$(((i + 1) * ${#ids[@]} / n))
    [ "$hi" -gt "$lo" ] || continue
    env ${KERNELS_ENV:-} timeout "${T_KERNELS:-420}" python3 -m pytest -q -p no:cacheprovider "${ids[@]:lo:hi-lo}" \
      ${KERNELS_ARGS:-} >"/tmp/kernels_shard$i.log" 2>&1 &
    pids+=($!) shards+=("$i")
  done
  for ((i = 0; i < ${#pids[@]}; i++)); do
    wait "${pids[i]}" || rc=1
    echo "--- kernels shard ${shards[i]}"; cat "/tmp/kernels_shard${shards[i]}.log"
  done
  return $rc
}
# tile-config sweep of the decode kernels (issue 3) and a profile of the HF mla_dcp step (issue 5)
stage_sweep() { timeout "${T_SWEEP:-300}" python3 benchmarks/decode_sweep.py "$OUT/decode_sweep.json" ${SWEEP_ARGS:-}; }
# a fresh Inductor cache per HF stage: a cached graph compiled with the mask as a plain input was seen to keep
# copying it after mark_static_address in the same machine (session 5, call 1)
stage_profile() { TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_PROFILE:-300}" python3 benchmarks/hf_profile.py "$OUT/hf_profile.json" ${PROFILE_ARGS:-}; }
# few-token linear layers (issue 5's HF step): mla_compile.kernels.linear configs vs cuBLAS
stage_linear() { timeout "${T_LINEAR:-300}" python3 benchmarks/linear_sweep.py "$OUT/linear_sweep.json" ${LINEAR_ARGS:-}; }
# linearsum: the lab bench of split-K fused_linear summed in its split launch (counters) vs a second launch
stage_linearsum() { timeout "${T_LINEARSUM:-200}" python3 benchmarks/lab/linear_sum_in_kernel.py "$OUT/linear_sum_in_kernel.json"; }
# decodemerge: the lab bench of split-KV decode merged in its stage-1 launch (ticketed merge programs) vs a second launch
stage_decodemerge() { timeout "${T_DECODEMERGE:-240}" python3 benchmarks/lab/decode_merge_in_kernel.py "$OUT/decode_merge_in_kernel.json"; }
# where the Gluon many-head decode kernel spends its time (phases dropped one at a time)
stage_wgmma() { echo "wgmma: the phase probe is retired (benchmarks/lab/README.md)"; }
stage_bench() { timeout "${T_BENCH:-400}" python3 benchmarks/bench_ops.py "$OUT/bench_ops.json" ${BENCH_ARGS:-}; }
# host (issue 29): host us per eager call of every op, next to FlashInfer / FlashMLA, and a profile of mla.decode
# multi-token decode (issue 27): S = 1 / 2 / 4 query tokens, auto's kernel and the pointer kernel side by side
stage_multi() { timeout "${T_MULTI:-200}" python3 benchmarks/multi_token.py "$OUT/multi_token.json"; }
# fp8 (issue 25): FP8 cache decode vs the bf16 cache, FlashMLA bf16 / FP8; FP8_ARGS="--sweep" adds other tilings
stage_fp8() { timeout "${T_FP8:-300}" python3 benchmarks/fp8_decode.py "$OUT/fp8_decode.json" ${FP8_ARGS:-}; }
stage_fp8probe() { echo "fp8probe: the FP8 kernel's lab probe is retired (benchmarks/lab/README.md)"; }
# select: dsa.indexer_topk's radix select kernel vs torch.topk + slots (benchmarks/indexer_select.py: graph, host us)
stage_select() { timeout "${T_SELECT:-200}" python3 benchmarks/indexer_select.py "$OUT/indexer_select.json"; }
# dcpindexer: the lab probe of dsa::dcp_indexer_topk's per-rank step vs the single-rank op (one GPU, no group)
stage_dcpindexer() { timeout "${T_DCPINDEXER:-200}" python3 benchmarks/lab/dcp_indexer_probe.py "$OUT/dcp_indexer.json"; }
# fp8swap: the lab probe of a swap-AB Gluon stage 1 for the FP8 cache at H 16-64 (check, then times beside mla.decode FP8
# / bf16 and FlashMLA); FP8SWAP_ARGS e.g. "--shapes 16:8:32768 --configs 16:8:3" or "--check-only"; "--table pages tiles
# runs holes shuffled": its GATHER and TOKENS forms over page-size-1 token tables beside the TMA form on pages
stage_fp8swap() { timeout "${T_FP8SWAP:-300}" python3 benchmarks/lab/fp8_swapab.py "$OUT/fp8_swapab.json" ${FP8SWAP_ARGS:-}; }
# swapab (issue 24): the lab probe of the few-head swap-AB Gluon stage 1 over a bf16 cache (check, then times beside the
# Triton kernel auto runs, FlashInfer and FlashMLA); SWAPAB_ARGS e.g. "--shapes 16:8:32768 --splits-scale 0.5 2"
stage_swapab() { timeout "${T_SWAPAB:-300}" python3 benchmarks/lab/swapab.py "$OUT/swapab.json" ${SWAPAB_ARGS:-}; }
# seesaw (issue 24): the lab probe of the many-head seesaw kernel over half-size tiles in two sets of slots (a full double
# buffer in the same shared memory), checked against float64 and the product kernel, then timed beside it and the peers;
# SEESAW_ARGS e.g. "--shapes 128:8:8192 --variants 32:2 64:1"
stage_seesaw() { timeout "${T_SEESAW:-300}" python3 benchmarks/lab/seesaw_n32.py "$OUT/seesaw_n32.json" ${SEESAW_ARGS:-}; }
# partials (issue 24): the lab probe of split-KV partial outs in bf16 instead of float32 (auto's own kernel, policy split
# count and around it, each checked against float64) beside the peers; PARTIALS_ARGS e.g. "--shapes 128:8:8192"
stage_partials() { timeout "${T_PARTIALS:-300}" python3 benchmarks/lab/partials_dtype.py "$OUT/partials_dtype.json" ${PARTIALS_ARGS:-}; }
stage_onelaunch() { echo "onelaunch: the lab probe is retired (benchmarks/lab/README.md)"; }
# eagersplits (issue 29): the lab probe of the split count for eager decode calls (graph replay vs back-to-back eager
# wall time at the policy's splits, a quarter, one); EAGERSPLITS_ARGS e.g. "--shapes 1:1024 8:4096 --filler 8"
stage_eagersplits() { timeout "${T_EAGERSPLITS:-240}" python3 benchmarks/lab/eager_splits.py "$OUT/eager_splits.json" ${EAGERSPLITS_ARGS:-}; }
stage_topkprobe() { echo "topkprobe: the lab probe is retired: its kernel is kernels/dsa.py's (stage select)"; }
stage_host() { timeout "${T_HOST:-180}" python3 benchmarks/host_overhead.py "$OUT/host.json" ${HOST_ARGS:-}; }
# hostab (issue 29): the ops table of this tree against another commit's mla_compile, alternating runs on this host
# (HOSTAB_ROUNDS, default 3). Carry the other one: `rm -rf .base && mkdir .base && git archive REV mla_compile |
# tar -x -C .base`, run(carry=[".whl", ".base"]). One file: $OUT/hostab.json (the table and every run)
stage_hostab() {
    [ -d .base/mla_compile ] || { echo "hostab: no .base/mla_compile (carry it)"; return 1; }
    local runs; runs=$(mktemp -d)
    # the order alternates by round: a host that drifts during the call (the second of two runs came out 4-8%
    # slower on untouched ops, RESULTS 2026-12-05 fourth session) then weighs on both sides alike
    local r side
    for r in $(seq "${HOSTAB_ROUNDS:-3}"); do
        for side in $([ $((r % 2)) -eq 1 ] && echo "base new" || echo "new base"); do
            HOST_ROOT=$([ "$side" = base ] && echo "$PWD/.base") timeout "${T_HOSTAB:-60}" \
                python3 benchmarks/host_overhead.py "$runs/hostab_${side}_$r.json" --ops-only
        done
    done
    python3 benchmarks/lab/host_ab.py "$runs" --json "$OUT/hostab.json"
}

# DCP (issue 4): torchrun n = 1, 2, 4 (those that fit the GPUs here), then one merged $OUT/dcp.json.
# DCP_NS picks the group sizes (default "1 2 4"), DCP_ARGS e.g. "--quick --no-compile", T_DCP limits each torchrun (s).
# Merge dcp.json files of separate calls later: python benchmarks/dcp_gpu.py --summarize all.json a/dcp.json b/dcp.json
stage_dcp() {
  local ngpu n rc=0 runs=() tmp=/tmp/dcp_runs
  ngpu=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  rm -rf "$tmp" && mkdir -p "$tmp"
  for n in ${DCP_NS:-1 2 4}; do
    [ "$n" -le "$ngpu" ] || { echo "--- dcp n=$n skipped: $ngpu GPU(s) here"; continue; }
    echo "--- dcp n=$n"
    timeout "${T_DCP:-240}" python3 -m torch.distributed.run --standalone --nproc-per-node "$n" \
      benchmarks/dcp_gpu.py "$tmp/dcp_n$n.json" ${DCP_ARGS:-} || { echo "dcp n=$n FAILED"; rc=1; }
    [ -f "$tmp/dcp_n$n.json" ] && runs+=("$tmp/dcp_n$n.json")
  done
  [ "${#runs[@]}" -gt 0 ] || return 1
  python3 benchmarks/dcp_gpu.py --summarize "$tmp/dcp.json" "${runs[@]}" && cp "$tmp/dcp.json" "$OUT/dcp.json"
  return $rc
}

# DSA (issue 6): mixed-batch indexer + dual graphs under CUDA-graph trees, then dense vs sparse benchmark
stage_dsa() {
  local rc=0
  timeout "${T_DSA_TEST:-240}" python3 -m pytest -q -p no:cacheprovider tests/gpu/test_dsa_cudagraphs.py tests/gpu/test_hf_dsa_cudagraphs.py \
    tests/ops/test_dsa_mixed_batch.py || rc=1
  timeout "${T_DSA_BENCH:-240}" python3 benchmarks/dsa_gpu.py "$OUT/dsa.json" || rc=1
  return $rc
}

# HF (issue 5): DeepseekV3 decode tokens/s, eager vs torch.compile default vs mla_dcp (HF_ARGS e.g. "--kv 4096")
stage_hf() { TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_HF:-400}" python3 benchmarks/hf_decode.py "$OUT/${HF_OUT:-hf.json}" ${HF_ARGS:-}; }

# generate: HF generate() end to end (eager vs HF's own static compile vs mla_dcp); GENERATE_ARGS e.g. "--heads 16"
stage_generate() { TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_GENERATE:-500}" python3 benchmarks/generate.py "$OUT/${GENERATE_OUT:-generate.json}" ${GENERATE_ARGS:-}; }
# genab: generate() at this tree and at another commit's mla_compile (carried as .base/mla_compile, as for hostab),
# one after the other with the same GENERATE_ARGS, each in its own process; $OUT/generate_new.json and
# $OUT/generate_base.json (each names the host and the stop checks its calls took: a slowdown between two sessions
# then splits into code and machine)
stage_genab() {
    [ -d .base/mla_compile ] || { echo "genab: no .base/mla_compile (carry it)"; return 1; }
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_GENAB:-250}" python3 benchmarks/generate.py \
        "$OUT/generate_new.json" ${GENERATE_ARGS:-}
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PYTHONPATH="$PWD/.base:$PYTHONPATH" timeout "${T_GENAB:-250}" \
        python3 benchmarks/generate.py "$OUT/generate_base.json" ${GENERATE_ARGS:-}
}
# gencrash: the lab probe of generate() recipes under CUDA graphs (writes failing Inductor sources under $OUT/gencrash)
stage_gencrash() { TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_GENCRASH:-300}" python3 benchmarks/lab/generate_crash.py "$OUT/gencrash" ${GENCRASH_ARGS:-}; }

# cb: HF continuous batching (generate_batch) uncompiled / Inductor / mla_dcp (CB_ARGS e.g. "--requests 16 --prompt 2048")
stage_cb() { TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_CB:-300}" python3 benchmarks/continuous_batching.py "$OUT/cb.json" ${CB_ARGS:-}; }

# genprofile: the lab profile of one generate() (host vs GPU time per token, top functions and kernels)
stage_genprofile() { TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_GENPROFILE:-300}" python3 benchmarks/lab/generate_profile.py "$OUT/genprofile.txt" ${GENPROFILE_ARGS:-}; }

# genhost: the lab probe of one generate() decode step's host time by HF loop part, and what removes it
stage_genhost() { TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_GENHOST:-500}" python3 benchmarks/lab/generate_host.py "$OUT/genhost.json" ${GENHOST_ARGS:-}; }

# families (issue 23): five HF MLA families' decode step at 32K (eager / torch.compile / mla_dcp, +reduce-overhead);
# FAMILIES_ARGS e.g. "--families deepseek_v3 deepseek_v32"; the script stops starting modes after --budget-s
stage_families() { TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) timeout "${T_FAMILIES:-480}" python3 benchmarks/families.py "$OUT/${FAMILIES_OUT:-families.json}" ${FAMILIES_ARGS:-}; }

# compile (issue 7): compile time, graphs, cudagraph recordings, FX-graph-cache hits of a second process
stage_compile() { timeout "${T_COMPILE:-300}" python3 benchmarks/compile_suite.py "$OUT/compile.json" ${COMPILE_ARGS:-}; }

# report: the generated RESULTS.md blocks from this call's JSON files (plots are drawn locally from the same JSON)
stage_report() {
  compgen -G "$OUT/*.json" >/dev/null || { echo "report: no JSON in \$OUT"; return 0; }
  python3 -m benchmarks report "$OUT" --md-out "$OUT/report.md" --no-plots --kind "${KIND:-unknown}" \
    --date "$(date -u +%F)" --command "bash benchmarks/device.sh $ARGS"
}

main() {
  setup
  local rc=0 stage s reported=0
  for stage in "${@:-kernels bench}"; do
    for s in $stage; do
      echo "=== stage $s ($(date +%T))"
      [ "$s" = report ] && reported=1
      if declare -F "stage_$s" >/dev/null; then "stage_$s" || { echo "=== stage $s FAILED"; rc=1; }
      else echo "=== unknown stage $s"; rc=1; fi
    done
  done
  if [ "$reported" = 0 ] && [ "${NO_REPORT:-0}" != 1 ]; then echo "=== report ($(date +%T))"; stage_report || rc=1; fi
  echo "=== files in \$OUT: $(ls "$OUT" | tr '\n' ' ')"
  return $rc
}

main "$@" 2>&1 | tee -a "$OUT/run.log"
exit "${PIPESTATUS[0]}"
