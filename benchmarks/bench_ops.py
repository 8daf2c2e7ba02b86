"""Op benchmarks on the GPU (not a test): mla::decode (Triton vs FlashInfer), merge_states, DSA indexer ops.

usage: python benchmarks/bench_ops.py [OUT.json] [--sweep] [--quick]
  --sweep  also time a few Triton tile configs per shape (to pick defaults)
  --quick  a small subset of shapes (smoke run)
Writes JSON (argv path, else $OUT/bench_ops.json, else ./bench_ops.json) and prints markdown tables.
Timing: triton.testing.do_bench median (L2 flushed between calls); Triton decode also by CUDA-graph replay.
Data is random (never zeros); each (batch, kv_len) gets a shuffled block table over one shared page pool.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import triton
from triton.testing import do_bench, do_bench_cudagraph

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile.kernels import decode as D
from mla_compile.kernels import dsa as DSA
from mla_compile.kernels import flashinfer_mla as FI
from mla_compile.kernels import merge as M

R, P, PS = 512, 64, 64
DT = torch.bfloat16
HEADS = (16, 128)
BATCHES = (1, 8, 32, 128)
LENS = (1024, 8192, 32768, 131072)
SWEEP = {  # DecodeConfig(block_h, block_n, num_warps, num_stages, ctas_per_sm[, max_splits])
    16: [D.DecodeConfig(16, 32, 4, 2, 2), D.DecodeConfig(16, 16, 4, 3, 2), D.DecodeConfig(16, 16, 4, 4, 2),
         D.DecodeConfig(16, 32, 4, 2, 3), D.DecodeConfig(16, 32, 2, 2, 2), D.DecodeConfig(16, 32, 4, 2, 2, 256)],
    128: [D.DecodeConfig(64, 64, 8, 1, 1), D.DecodeConfig(64, 128, 8, 1, 1), D.DecodeConfig(64, 64, 8, 2, 1),
          D.DecodeConfig(64, 32, 8, 1, 1), D.DecodeConfig(64, 64, 8, 1, 2)],
}


def ms(fn, graph=False):
    if graph:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    return do_bench(fn, warmup=10, rep=60, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    x = torch.randn(1 << 30, device="cuda", dtype=torch.float16)  # 2 GiB
    y = torch.empty_like(x)
    t = ms(lambda: y.copy_(x))
    return 2 * x.numel() * x.element_size() / (t * 1e-3)


def cfg_name(c: D.DecodeConfig) -> str:
    return f"h{c.block_h}n{c.block_n}w{c.num_warps}s{c.num_stages}c{c.ctas_per_sm}m{c.max_splits}"


def bench_decode(results, copy_bw, sweep, shapes):
    max_tokens = max(b * n for b, n in shapes)
    num_pages = max_tokens // PS
    ckv = torch.empty(num_pages, PS, R, dtype=DT, device="cuda").normal_()
    kpe = torch.empty(num_pages, PS, P, dtype=DT, device="cuda").normal_()
    scale = 192 ** -0.5
    for B, L in shapes:
        table = torch.randperm(num_pages, device="cuda")[: B * L // PS].view(B, L // PS).int()
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        for H in HEADS:
            qn = torch.randn(B, H, R, dtype=DT, device="cuda")
            qp = torch.randn(B, H, P, dtype=DT, device="cuda")
            row = dict(H=H, B=B, L=L)
            nbytes = D.kv_bytes(B, L, R, P, 2)
            flop = D.flops(B, H, L, R, P)
            cfg = D.default_config(H, R, PS)
            row["splits"] = D.num_splits(B, H, L, qn.device, cfg)
            run = lambda c=None: D.decode(qn, qp, ckv, kpe, table, lens, scale, cfg=c)  # noqa: E731
            row["triton_ms"] = ms(run)
            row["triton_graph_ms"] = ms(run, graph=True)
            if cfg.wgmma:  # the Triton TMA kernel the Gluon one replaced, side by side
                row["triton_tma_graph_ms"] = ms(lambda: run(dataclasses.replace(cfg, wgmma=False)), graph=True)
            if FI.available():
                try:
                    fi_run = FI.plan(qn, qp, ckv, table, lens, scale).raw
                    fi_run(qn, qp, ckv, kpe)
                    row["flashinfer_ms"] = ms(lambda: fi_run(qn, qp, ckv, kpe))
                    row["ratio"] = row["triton_ms"] / row["flashinfer_ms"]
                    row["flashinfer_bw_frac"] = nbytes / (row["flashinfer_ms"] * 1e-3) / copy_bw
                except Exception as e:  # report, keep going
                    row["flashinfer_error"] = repr(e)[:300]
            if sweep:
                row["sweep"] = {}
                for c in SWEEP[H]:
                    try:
                        row["sweep"][cfg_name(c)] = ms(lambda: run(c))
                    except Exception as e:
                        row["sweep"][cfg_name(c)] = repr(e)[:200]
                ok = {k: v for k, v in row["sweep"].items() if isinstance(v, float)}
                if ok:
                    row["best_cfg"] = min(ok, key=ok.get)
                    row["best_ms"] = ok[row["best_cfg"]]
            best = min(row["triton_ms"], row.get("best_ms", float("inf")))
            row["triton_bw_frac"] = nbytes / (row["triton_ms"] * 1e-3) / copy_bw
            row["triton_tflops"] = flop / (row["triton_ms"] * 1e-3) / 1e12
            row["best_bw_frac"] = nbytes / (best * 1e-3) / copy_bw
            row["best_tflops"] = flop / (best * 1e-3) / 1e12
            results["decode"].append(row)
            print(json.dumps(row), flush=True)
        del table
    del ckv, kpe
    torch.cuda.empty_cache()


def bench_host(results):
    """Host time per eager call (launch overhead), small shape: what do_bench's eager numbers include."""
    B, H, L = 1, 16, 1024
    ckv = torch.randn(L // PS + 1, PS, R, dtype=DT, device="cuda")
    kpe = torch.randn(L // PS + 1, PS, P, dtype=DT, device="cuda")
    table = torch.arange(L // PS, dtype=torch.int32, device="cuda")[None]
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qn, qp = torch.randn(B, H, R, dtype=DT, device="cuda"), torch.randn(B, H, P, dtype=DT, device="cuda")
    fns = {"triton decode (2 kernels)": lambda: D.decode(qn, qp, ckv, kpe, table, lens, 0.1),
           "triton decode, 1 split": lambda: D.decode(qn, qp, ckv, kpe, table, lens, 0.1, splits=1),
           "torch.ops.mla.decode": lambda: torch.ops.mla.decode(qn, qp, ckv, kpe, table, lens, 0.1),
           "4x torch.empty": lambda: [torch.empty(16, device="cuda") for _ in range(4)]}
    if FI.available():
        fi_run = FI.plan(qn, qp, ckv, table, lens, 0.1).raw
        fns["flashinfer run"] = lambda: fi_run(qn, qp, ckv, kpe)
    results["host_us"] = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(300):
            fn()
        torch.cuda.synchronize()
        results["host_us"][name] = (time.perf_counter() - t0) / 300 * 1e6
    print(json.dumps(results["host_us"]), flush=True)


def bench_merge(results):
    N, B, H = 8, 128, 128
    outs = torch.randn(N, B, H, R, dtype=DT, device="cuda")
    lses = torch.randn(N, B, H, device="cuda") * 3
    t = ms(lambda: M.merge_states(outs, lses))
    dec = [r for r in results["decode"] if (r["H"], r["B"], r["L"]) == (128, 128, 32768)]
    row = dict(N=N, B=B, H=H, merge_ms=t, bytes=outs.numel() * 2 + B * H * R * 2 + lses.numel() * 4)
    if dec:
        row["decode_32k_ms"] = dec[0]["triton_ms"]
        row["fraction_of_decode"] = t / dec[0]["triton_ms"]
    results["merge"] = row
    print(json.dumps(row), flush=True)


def bench_dsa(results):
    L, Hi, Di, topk = 2048, 64, 128, 2048
    results["dsa"] = []
    for B in (8, 64):
        pages = B * L // PS
        k_cache = torch.randn(pages + 1, PS, Di, dtype=DT, device="cuda")
        table = torch.randperm(pages + 1, device="cuda")[:pages].view(B, L // PS).int()
        lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
        q = torch.randn(B, Hi, Di, dtype=DT, device="cuda")
        w = torch.randn(B, Hi, device="cuda") * Hi ** -0.5
        idx = lambda: torch.ops.dsa.indexer_topk(q, w, k_cache, table, lens, topk, Di ** -0.5)  # noqa: E731
        konly = lambda: torch.ops.dsa.k_only_indices(table, lens, PS, topk)  # noqa: E731
        row = dict(B=B, L=L, Hi=Hi, Di=Di, topk=topk)
        row["indexer_ms"], row["k_only_ms"] = ms(idx), ms(konly)
        row["indexer_graph_ms"], row["k_only_graph_ms"] = ms(idx, graph=True), ms(konly, graph=True)
        row["speedup"] = row["indexer_ms"] / row["k_only_ms"]
        row["speedup_graph"] = row["indexer_graph_ms"] / row["k_only_graph_ms"]
        results["dsa"].append(row)
        print(json.dumps(row), flush=True)
        del k_cache


def table(results) -> str:
    cb = results["copy_bw_TBps"]
    lines = [f"copy bandwidth {cb:.2f} TB/s (read+write); bf16 R{R}/P{P}, page {PS}; times in us (do_bench median)",
             "", "| H | B | kv_len | splits | Triton | Triton graph | FlashInfer | ratio T/FI | bw frac T | bw frac FI "
             "| TFLOP/s T | best sweep cfg | best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results["decode"], key=lambda r: (r["H"], r["B"], r["L"])):
        f = lambda k, s=1e3, fmt="{:.1f}": fmt.format(r[k] * s) if isinstance(r.get(k), float) else "-"  # noqa
        lines.append(f"| {r['H']} | {r['B']} | {r['L'] // 1024}K | {r['splits']} | {f('triton_ms')} | "
                     f"{f('triton_graph_ms')} | {f('flashinfer_ms')} | {f('ratio', 1, '{:.2f}')} | "
                     f"{f('triton_bw_frac', 1, '{:.2f}')} | {f('flashinfer_bw_frac', 1, '{:.2f}')} | "
                     f"{f('triton_tflops', 1, '{:.0f}')} | {r.get('best_cfg', '-')} | {f('best_ms')} |")
    if results.get("host_us"):
        lines += ["", "host us per eager call (B=1 H=16 1K): "
                  + ", ".join(f"{k} {v:.0f}" for k, v in results["host_us"].items())]
    m = results.get("merge")
    if m:
        lines += ["", f"merge_states N={m['N']} B={m['B']} H={m['H']}: {m['merge_ms'] * 1e3:.1f} us"
                  + (f" = {m['fraction_of_decode']:.3f} of one 32K decode ({m['decode_32k_ms'] * 1e3:.0f} us)"
                     if "fraction_of_decode" in m else "")]
    for d in results.get("dsa", []):
        lines.append(f"B={d['B']} kv_len {d['L']} Hi={d['Hi']} Di={d['Di']} topk {d['topk']}: indexer_topk "
                     f"{d['indexer_ms'] * 1e3:.1f} us (graph {d['indexer_graph_ms'] * 1e3:.1f}), k_only "
                     f"{d['k_only_ms'] * 1e3:.1f} us (graph {d['k_only_graph_ms'] * 1e3:.1f}): "
                     f"{d['speedup']:.0f}x (graph {d['speedup_graph']:.0f}x)")
    return "\n".join(lines)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default=os.path.join(os.environ.get("OUT", "."), "bench_ops.json"))
    ap.add_argument("--sweep", action="store_true", help="also time a few Triton tile configs per shape")
    ap.add_argument("--quick", action="store_true", help="a small subset of shapes (smoke run)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (Triton / FlashInfer kernels, CUDA-graph timing); none here")
    path, quick = a.out, a.quick
    shapes = [(b, n) for b in ((1, 8) if quick else BATCHES) for n in ((1024, 32768) if quick else LENS)]
    t0 = time.time()
    results = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   flashinfer=FI.available(), decode=[])
    results["copy_bw_TBps"] = copy_bandwidth() / 1e12
    bench_decode(results, results["copy_bw_TBps"] * 1e12, a.sweep, shapes)
    bench_host(results)
    bench_merge(results)
    bench_dsa(results)
    results["wall_s"] = time.time() - t0
    with open(path, "w") as fh:
        json.dump(results, fh, indent=1)
    print(table(results))


if __name__ == "__main__":
    main(sys.argv[1:])
