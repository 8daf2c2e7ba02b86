"""Few-token linear layers on the GPU: mla_compile.kernels.linear configs vs cuBLAS (not a test).

usage: python benchmarks/linear_sweep.py OUT.json [--quick]

The shapes are the projections of benchmarks/hf_decode.py's DeepseekV3 decode step (batch 8, hidden 2048):
q_a + kv_a (one launch here, two cuBLAS GEMMs there), q_b, o_proj, gate + up, down, lm_head, and the H=128
q_b / o_proj. Each case rotates over enough weight copies that every call reads its weights from HBM (as a
decode step does: 130+ MB of weights per layer), times CUDA-graph replays (`do_bench_cudagraph` median), and
first checks every config against float64. Reported: us per call, weight bandwidth (bytes / time) and the
ratio to cuBLAS.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
from triton.testing import do_bench_cudagraph

from mla_compile.kernels.linear import LinearConfig, default_linear_config, linear_small_m

SHAPES = {  # name: (M, K, [N of each weight sharing x])
    "q_a+kv_a": (8, 2048, [1536, 576]),
    "q_b": (8, 1536, [3072]),
    "o_proj": (8, 2048, [2048]),
    "gate+up": (8, 2048, [8192, 8192]),
    "down": (8, 8192, [2048]),
    "o_proj h128": (8, 16384, [2048]),
    # DeepSeek-V3's own dims (hidden 7168, MoE shared expert 2048, dense MLP 18432, 128 heads)
    "dsv3 q_a+kv_a": (8, 7168, [1536, 576]),
    "dsv3 shared gate+up": (8, 7168, [2048, 2048]),
    "dsv3 dense gate+up": (8, 7168, [18432, 18432]),
    "dsv3 o_proj": (8, 16384, [7168]),
    "q_a+kv_a m1": (1, 2048, [1536, 576]),
    "q_a+kv_a m16": (16, 2048, [1536, 576]),
}
# The round files (data/linear_sweep_roundN.json) are read at commit 20a0395: git show 20a0395:benchmarks/<file>.
# Round 1 (data/linear_sweep_round1.json): block_n 16/32/64 x block_k 128/256/512 x 3/4/6 stages, no split.
# Round 2: the round-1 leaders, each with K split 1/2/4/8 ways (fp32 partials + one summing launch).
CONFIGS = {f"n{bn}k{bk}s{st}" + (f"x{sk}" if sk > 1 else ""): LinearConfig(bn, bk, 4, st, sk)
           for bn, bk, st in [(16, 256, 4), (16, 128, 6), (16, 256, 3), (32, 128, 3), (32, 128, 4)]
           for sk in (1, 2, 4, 8)}
L2_BYTES = 50 << 20


def rotating(ws_bytes: int) -> int:
    """Weight copies so one pass over them streams > 2x the L2 from HBM."""
    return max(2, -(-4 * L2_BYTES // ws_bytes))


def bench_case(name, M, K, Ns, configs, dev):
    gen = torch.Generator(device=dev).manual_seed(len(name))
    x = torch.randn(M, K, device=dev, generator=gen).to(torch.bfloat16)
    wbytes = sum(N * K * 2 for N in Ns)
    copies = [[(torch.randn(N, K, device=dev, generator=gen) * K ** -0.5).to(torch.bfloat16) for N in Ns]
              for _ in range(rotating(wbytes))]
    ref = [x.double() @ w.double().T for w in copies[0]]
    outs = [x.new_empty(M, N) for N in Ns]
    row = {"M": M, "K": K, "N": Ns, "weight_MB": wbytes / 1e6, "us": {}, "err": {}}

    def max_rel_err(ys):  # vs float64, over the outputs of every weight
        return max(float((y.double() - r).abs().max() / r.abs().max()) for y, r in zip(ys, ref))

    def timed(call, pool=copies):
        it = itertools.cycle(pool)  # each captured call reads the next copy's weights
        return do_bench_cudagraph(lambda: call(next(it)), rep=40, return_mode="median") * 1e3

    row["us"]["cublas"] = timed(lambda ws: [torch.mm(x, w.T, out=o) for w, o in zip(ws, outs)])
    if len(Ns) > 1:
        cats = [torch.cat(ws) for ws in copies]
        y = x.new_empty(M, sum(Ns))
        row["us"]["cublas concat"] = timed(lambda w: torch.mm(x, w.T, out=y), cats)
        del cats
    for cname, cfg in configs.items():
        try:
            ys = linear_small_m(x, copies[0], cfg)
        except triton.runtime.errors.OutOfResources as e:  # e.g. too many stages of wide tiles
            row["us"][cname] = None
            row["err"][cname] = str(e)[:80]
            continue
        err = max_rel_err(ys)
        row["err"][cname] = err
        if err > 1e-2:
            row["us"][cname] = None
            print(f"  {name} {cname}: WRONG (rel err {err:.2e})", flush=True)
            continue
        row["us"][cname] = timed(lambda ws, cfg=cfg: linear_small_m(x, ws, cfg, outs))
    default = default_linear_config(M, K, sum(Ns))
    ys = linear_small_m(x, copies[0])
    row["err"]["default"] = max_rel_err(ys)
    row["us"]["default"] = timed(lambda ws: linear_small_m(x, ws, None, outs))
    row["default_config"] = str(default)
    ok = {k: v for k, v in row["us"].items() if v is not None and k not in ("cublas", "cublas concat", "default")}
    best = min(ok, key=ok.get)
    row["best"] = best
    row["ratio_best_vs_cublas"] = ok[best] / row["us"]["cublas"]
    row["ratio_default_vs_cublas"] = row["us"]["default"] / row["us"]["cublas"]
    row["TBps"] = {k: wbytes / (v * 1e-6) / 1e12 for k, v in row["us"].items() if v}
    print(f"{name:14s} M={M} K={K} N={Ns}: cublas {row['us']['cublas']:.1f} us "
          f"({row['TBps']['cublas']:.2f} TB/s)"
          + (f", cublas concat {row['us']['cublas concat']:.1f}" if len(Ns) > 1 else "")
          + f" | best {best} {ok[best]:.1f} us ({row['TBps'][best]:.2f} TB/s, x{row['ratio_best_vs_cublas']:.2f})"
          + f" | default {row['us']['default']:.1f} us", flush=True)
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--quick", action="store_true", help="three configs, three shapes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("linear_sweep needs a GPU")
    shapes, configs = SHAPES, CONFIGS
    if args.quick:
        shapes = {k: SHAPES[k] for k in ("q_a+kv_a", "q_b", "down")}
        configs = {k: CONFIGS[k] for k in ("n16k256s4", "n16k256s4x4", "n32k128s3")}
    rows = {}
    for name, (M, K, Ns) in shapes.items():
        rows[name] = bench_case(name, M, K, Ns, configs, "cuda")
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
