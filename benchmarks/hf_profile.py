"""Where an HF DeepseekV3 `mla_dcp` decode step spends its time (torch.profiler; not a test).

usage: python benchmarks/hf_profile.py OUT.json [--heads 16] [--kv 4096 32768] [--batch 8] [--layers 4]
                                           [--kv-cache-dtype auto|fp8_e4m3]
                                           [--variants input static static+nopdl ...] [--step model|greedy]
                                           [--ab ROUNDS]

The model and cache are those of benchmarks/hf_decode.py. After warm-up (compile + CUDA-graph recording) it
times `--steps` steps by wall clock, then profiles 5 steps and reports per step: wall time, summed GPU kernel
time, the kernels by total time (name, calls per step, us per step), and the idle time between consecutive
kernels by size (so launch gaps inside the graph and host stalls between steps are told apart).

Variants (each a fresh compile of the same model and cache), see VARIANTS: how the harness hands over the
attention mask (`input`: a plain tensor, copied by the CUDA-graph tree before every replay; `static`: marked
static, as a serving loop's persistent buffer would be) and backend options (`pdl`: Inductor's programmatic
dependent launch), and experiments that undo one default at a time.

`--ab ROUNDS` (greedy step, static-mask variants) profiles nothing: it compiles every variant on one model and
cache and times them round-robin, ROUNDS x `--steps` steps each, reporting each variant's median and its difference
to the first variant - the way to tell a few us apart (separate processes drift by 20-30 us).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import sys
import time
import types
from unittest import mock

import torch

from mla_compile import tuning

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_decode import build_model, decode, filled_cache, greedy_step, rewind, sync  # noqa: E402


# kernel name -> where its time goes (first match wins); everything else is Inductor's fused small kernels
CATEGORIES = [
    ("attention", ("_stage1", "_merge_kernel", "flashinfer", "mla_")),
    ("projections", ("nvjet", "gemm", "gemv", "cublas", "cutlass", "_linear_kernel", "_sum_splits")),
    ("harness (mask copy, argmax)", ("multi_tensor_apply", "ArgMax")),
]


def categorize(row: dict) -> dict:
    """us per step by category (CATEGORIES, then "small fused kernels" and "gaps" = wall - GPU time), from a
    profile row; only the top kernels are listed in a row, so the rest of the GPU time counts as small kernels."""
    out = {name: 0.0 for name, _ in CATEGORIES}
    for k in row["top"]:
        name = next((c for c, keys in CATEGORIES if any(key.lower() in k["name"].lower() for key in keys)), None)
        if name is not None:
            out[name] += k["us_per_step"]
    out["small fused kernels"] = row["gpu_kernel_us_per_step"] - sum(out.values())
    out["gaps between kernels"] = row["wall_us_per_step"] - row["gpu_kernel_us_per_step"]
    return out


# variant -> (mask marked static?, backend options, Tuning (mla_compile/tuning.py), environment switches): each
# experiment undoes one default through the public surface (a Tuning field or a process-wide env var), never a
# module's private name.
# Programmatic dependent launch is on by default (ours and Inductor's): a kernel's profiled time then includes
# waiting for its predecessor, so per-kernel attribution wants "static+nopdl"
_NO_PDL_OURS = {"MLA_COMPILE_PDL": "0"}
DEFAULT = tuning.Tuning()
VARIANTS = {
    "input": (False, {}, DEFAULT, {}),
    "static": (True, {}, DEFAULT, {}),
    "static+nopdl": (True, {"triton.enable_pdl": False}, DEFAULT, _NO_PDL_OURS),
    "static+pdl_inductor_only": (True, {}, DEFAULT, _NO_PDL_OURS),
    "static+pdl_ours_only": (True, {"triton.enable_pdl": False}, DEFAULT, {}),
    "static+nocombo": (True, {"combo_kernels": False}, DEFAULT, {}),
    # the measured defaults undone one at a time: lone linears only with K >= 8192 (q_b, o_proj to cuBLAS); W_UK /
    # W_UV as cuBLAS bmms; both (the step before those two defaults); and the greedy pick as one whole-row argmax
    "static+cublas_small": (True, {}, tuning.Tuning(lone_linear_min_k=8192), {}),
    "static+absorb_bmm": (True, {}, tuning.Tuning(absorb="bmm"), {}),
    "static+session6": (True, {}, tuning.Tuning(lone_linear_min_k=8192, absorb="bmm"), {}),
    "static+whole_argmax": (True, {}, tuning.Tuning(split_argmax_max_rows=0), {}),
    # lm_head to the few-token kernel too (measured 744 vs 727 us wall: slower)
    "static+lone_linears": (True, {}, tuning.Tuning(lone_linear_max_n=1 << 30), {}),
    # our own many-head kernels instead of `auto` (FlashMLA where it is installed and the caches share rows)
    "static+triton_decode": (True, {}, tuning.Tuning(decode_kernel="triton"), {}),
    # the swap-AB kernels' TOKENS form over the pass's token table, switched on / off whatever the kernels' defaults
    # (decode_swapab / decode_fp8_swapab TOKENS_IN_AUTO): with an FP8 cache the FP8 kernel's TOKENS vs GATHER forms
    "static+tokens": (True, {}, DEFAULT, {tuning.SWAPAB_TOKENS_ENV: "1"}),
    "static+notokens": (True, {}, DEFAULT, {tuning.SWAPAB_TOKENS_ENV: "0"}),
    # the bf16 TOKENS form asked for by name
    "static+swapab_decode": (True, {}, tuning.Tuning(decode_kernel="swapab"), {}),
    # the Gluon kernels without programmatic dependent launch (kernels/_gluon.py pdl_launch; on by default)
    "static+no_gluon_pdl": (True, {}, DEFAULT, {tuning.GLUON_PDL_ENV: "0"}),
}


def experiment(variant: str) -> contextlib.ExitStack:
    """The variant's Tuning and environment switches as one context (what the variant compiles, records and runs
    under)."""
    _, _, tune, env = VARIANTS[variant]
    stack = contextlib.ExitStack()
    if env:
        stack.enter_context(mock.patch.dict(os.environ, env))
    stack.enter_context(tuning.use(tune))
    return stack


GAP_BUCKETS_US = (1.0, 2.0, 5.0, 20.0)


def gap_stats(events, steps: int) -> dict:
    """Idle time between consecutive GPU kernels (one stream): per step, summed by size bucket, plus the largest
    gaps with the kernels on either side. `events` = [(start_us, end_us, name)]."""
    events = sorted(events)
    gaps = [(b[0] - a[1], a[2], b[2]) for a, b in zip(events, events[1:])]
    edges = (0.0,) + GAP_BUCKETS_US + (float("inf"),)
    buckets = {}
    for lo, hi in zip(edges, edges[1:]):
        sel = [g for g, _, _ in gaps if lo <= g < hi]
        buckets[f"{lo:g}-{hi:g}us"] = {"count_per_step": len(sel) / steps, "us_per_step": sum(sel) / steps}
    largest = sorted(gaps, key=lambda g: -g[0])[:8]
    return {"buckets": buckets, "largest": [{"us": g, "after": a[:80], "before": b[:80]} for g, a, b in largest]}


def model_cache_mask(H, kv, args, device):
    """The benchmark model (hf_decode.py's), its StaticCache filled to kv, and an all-ones attention mask."""
    max_len = kv + 64 * args.steps
    model = build_model(H, args.layers, args.hidden, args.vocab, torch.bfloat16, device, small=args.smoke)
    cache = filled_cache(model, args.batch, kv, max_len, device, kv_cache_dtype=args.kv_cache_dtype)
    return model, cache, torch.ones(args.batch, max_len, dtype=torch.long, device=device)


def wall_us_per_step(run, steps: int, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    run(steps)
    sync(device)
    return (time.perf_counter() - t0) / steps * 1e6


def profile_case(H, kv, args, device, variant="input"):
    model, cache, mask = model_cache_mask(H, kv, args, device)
    static_mask, options, _, _ = VARIANTS[variant]
    with experiment(variant):
        return _profile(H, kv, args, device, variant, model, cache, mask, static_mask, options)


def _profile(H, kv, args, device, variant, model, cache, mask, static_mask, options):
    B = args.batch
    if static_mask:
        torch._dynamo.mark_static_address(mask)
    tok = torch.ones(B, 1, dtype=torch.long, device=device)
    step_model = model if args.step == "greedy" else None  # --step greedy: model + argmax as one compiled step
    target = greedy_step(model) if step_model is not None else model
    fn = torch.compile(target, backend="mla_dcp", options={"mode": "reduce-overhead", **options}, fullgraph=True)
    run = lambda steps: decode(fn, cache, tok, mask, kv, steps, model=step_model)  # noqa: E731
    run(4)  # compile + record
    rewind(cache, kv)
    wall_us = wall_us_per_step(run, args.steps, device)
    rewind(cache, kv)
    n = 5
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        run(n)
        torch.cuda.synchronize()
    kernels = collections.defaultdict(lambda: [0, 0.0])
    spans = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:120]]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
            spans.append((e.time_range.start, e.time_range.end, e.name))
    gpu_us = sum(v[1] for v in kernels.values()) / n
    top = sorted(kernels.items(), key=lambda kv_: -kv_[1][1])[:30]
    row = {"variant": variant, "step": args.step, "H": H, "kv_len": kv, "batch": B,
           "kv_cache_dtype": args.kv_cache_dtype, "wall_us_per_step": wall_us, "gpu_kernel_us_per_step": gpu_us,
           "kernels_per_step": sum(v[0] for v in kernels.values()) / n,
           "top": [{"name": k, "calls_per_step": v[0] / n, "us_per_step": v[1] / n} for k, v in top]}
    row["gaps"] = gap_stats(spans, n)
    print(f"[{variant}] H={H} kv={kv}: wall {wall_us:.0f} us/step, GPU kernels {gpu_us:.0f} us/step, "
          f"{row['kernels_per_step']:.0f} kernels/step", flush=True)
    for t in row["top"]:
        print(f"   {t['us_per_step']:8.1f} us  {t['calls_per_step']:5.1f}x  {t['name']}", flush=True)
    row["categories"] = categorize(row)
    print("   by category: " + ", ".join(f"{k} {v:.0f} us" for k, v in row["categories"].items()), flush=True)
    print("   idle between kernels: " + ", ".join(f"{k} {v['count_per_step']:.0f}x {v['us_per_step']:.0f} us"
                                                   for k, v in row["gaps"]["buckets"].items()), flush=True)
    for g in row["gaps"]["largest"][:4]:
        print(f"   gap {g['us']:.1f} us after {g['after']} before {g['before']}", flush=True)
    del fn, model, cache
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return row


def ab_case(H, kv, args, device, variants, rounds: int) -> dict:
    """Wall time per step of each variant, compiled side by side on one model and cache and timed round-robin
    (`rounds` x `--steps` steps each): differences of a few us stay visible above the run-to-run drift that
    separate processes show (session 6: the same build 0.687-0.717 ms across processes)."""
    B = args.batch
    model, cache, mask = model_cache_mask(H, kv, args, device)
    torch._dynamo.mark_static_address(mask)
    tok = torch.ones(B, 1, dtype=torch.long, device=device)
    assert args.step == "greedy", "--ab times the greedy step (--step greedy)"
    runs = {}
    for variant in variants:
        static_mask, options, tune, _ = VARIANTS[variant]
        assert static_mask, f"--ab compares static-mask variants only, not {variant}"
        # Dynamo caches compiled code per code object and backend; variants that differ only in their Tuning or
        # environment (same backend, equal options) would reuse the first one's code: each variant gets a step
        # function with a code object of its own
        step = greedy_step(model)
        target = types.FunctionType(step.__code__.replace(co_name=f"step_{len(runs)}"), step.__globals__,
                                    closure=step.__closure__)
        with experiment(variant):  # active while the variant compiles and records its graphs
            fn = torch.compile(target, backend="mla_dcp", options={"mode": "reduce-overhead", **options},
                               fullgraph=True)
            run = lambda steps, fn=fn: decode(fn, cache, tok, mask, kv, steps, model=model)  # noqa: E731
            runs[variant] = tuning.bind(run, tune)  # its kernel choices when it runs, too
            runs[variant](4)
            rewind(cache, kv)
    samples = {v: [] for v in variants}
    for _ in range(rounds):
        for variant, run in runs.items():
            samples[variant].append(wall_us_per_step(run, args.steps, device))
            rewind(cache, kv)
    median = {v: sorted(x)[len(x) // 2] for v, x in samples.items()}
    base = median[variants[0]]
    for v in variants:
        print(f"[ab] H={H} kv={kv} {v:24s} median {median[v]:7.1f} us/step ({median[v] - base:+6.1f} vs "
              f"{variants[0]}), samples {' '.join(f'{x:.0f}' for x in samples[v])}", flush=True)
    del runs, model, cache
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return {"ab": True, "step": args.step, "H": H, "kv_len": kv, "batch": B, "steps": args.steps, "rounds": rounds,
            "median_us_per_step": median, "samples_us_per_step": samples}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--heads", type=int, nargs="+", default=[16])
    ap.add_argument("--kv", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_e4m3"], default="auto",
                    help="fp8_e4m3: hf_decode's FP8 DSAStaticCache (the latent in FP8, 656 bytes a token)")
    ap.add_argument("--variants", nargs="+", default=["input"], choices=sorted(VARIANTS))
    ap.add_argument("--step", choices=["model", "greedy"], default="model",
                    help="profile the compiled model (argmax eagerly after it) or model + argmax as one step")
    ap.add_argument("--ab", type=int, default=0, metavar="ROUNDS",
                    help="instead of profiling: time the variants side by side, round-robin, ROUNDS rounds")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, CPU ok (checks the script; --ab only)")
    args = ap.parse_args(argv)
    import mla_compile  # noqa: F401

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        args.heads, args.kv, args.batch, args.layers, args.hidden, args.vocab, args.steps = [4], [64], 2, 1, 64, 128, 2

    # variants differ in what the caches do not key on (a static mask was still copied when the graph came from
    # the cache of the "input" variant, session 5 call 1): compile each one from scratch
    with torch._inductor.config.patch(force_disable_caches=True):
        rows = []
        for H in args.heads:
            for kv in args.kv:
                if args.ab:
                    rows.append(ab_case(H, kv, args, device, args.variants, args.ab))
                else:
                    rows.extend(profile_variants(H, kv, args, device))
                with open(args.out, "w") as fh:
                    json.dump({"torch": torch.__version__, "rows": rows}, fh, indent=1)
    return 0


def profile_variants(H, kv, args, device) -> list[dict]:
    rows = []
    for variant in args.variants:
        try:
            rows.append(profile_case(H, kv, args, device, variant))
        except Exception as e:  # noqa: BLE001 - recorded; the next variant still runs
            rows.append({"variant": variant, "H": H, "kv_len": kv, "error": f"{type(e).__name__}: {e}"[:2000]})
            print(f"[{variant}] H={H} kv={kv} FAILED: {rows[-1]['error']}", flush=True)
            torch._dynamo.reset()
    return rows


if __name__ == "__main__":
    sys.exit(main())
