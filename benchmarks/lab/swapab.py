"""Lab probe of the few-head swap-AB Gluon stage 1 over a bf16 cache (mla_compile/kernels/decode_swapab.py: the kernel
and its design are explained there). Question: at 16-32 heads, is the cache streamed by TMA into an MMA whose M is
tokens faster than the Triton pointer kernel `auto` runs there, and than FlashMLA / FlashInfer, and at which split
counts?

    python benchmarks/lab/swapab.py OUT.json [--shapes H:B:KV ...] [--splits-scale 0.5 2] [--table pages runs shuffled]
                                             [--tiling 64:8]
    SWAPAB_ARGS="..." bash benchmarks/device.sh swapab

--table: "pages" (default; page 64, shuffled pages), or a page-size-1 token table (what the HF pass hands over: the
kernel's TOKENS form), "runs" (each request one run of consecutive rows off the tile edges: a static cache, every
tile a TMA box) or "shuffled" (rows anywhere: every tile row copies); the Triton kernel is timed beside it
("triton"). --tiling N:warps: builds timed beside the default one at their own policy split count ("swapab N64";
e.g. 64:8 at 33-63 heads: the cache read once, not by two blocks of 32).
Per shape and table (the same data for every column): request 0 against float64 and the whole batch
against the Triton kernel (out, lse), then CUDA-graph replay medians (do_bench_cudagraph) side by side: the Triton
kernel auto runs today, the swap-AB kernel at the policy's split count (and at that count times each
--splits-scale), FlashInfer's `run` (planned outside the graph) and FlashMLA alone (its schedule made inside the
call) when they import; copy-bandwidth fractions of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_ops' helpers

import bench_ops as BO  # noqa: E402
from mla_compile.kernels import decode as D  # noqa: E402
from mla_compile.kernels import dispatch  # noqa: E402

SHAPES = ("16:8:8192", "16:8:32768", "16:32:8192", "16:32:32768", "16:1:32768", "16:128:32768", "16:32:131072",
          "32:8:32768")


def caches(B: int, L: int, kind: str):
    """(ckv, kpe, table) of B requests of L tokens: pages of 64 shuffled, or a page-size-1 cache under a token table
    ("runs": request b at rows b * (L + 64) + an offset in [1, 63], "shuffled": rows anywhere)."""
    R, P, DT = BO.R, BO.P, BO.DT
    PS, N = (BO.PS, B * L // BO.PS) if kind == "pages" else (1, B * (L + 64))
    ckv = torch.empty(N, PS, R, dtype=DT, device="cuda").normal_()
    kpe = torch.empty(N, PS, P, dtype=DT, device="cuda").normal_()
    if kind == "runs":
        first = torch.arange(B, device="cuda") * (L + 64) + torch.randint(1, 64, (B,), device="cuda")
        table = (first[:, None] + torch.arange(L, device="cuda")).int()
    else:
        table = torch.randperm(N, device="cuda")[:B * L // PS].view(B, L // PS).int()
    return ckv, kpe, table


def run_shape(H: int, B: int, L: int, scales, copy_bw: float, kind: str = "pages", tilings=()) -> dict:
    R, P, DT = BO.R, BO.P, BO.DT
    scale = 192 ** -0.5
    ckv, kpe, table = caches(B, L, kind)
    lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    qn = torch.randn(B, H, R, dtype=DT, device="cuda")
    qp = torch.randn(B, H, P, dtype=DT, device="cuda")
    nbytes = D.kv_bytes(B, L, R, P, 2)
    row = dict(H=H, B=B, L=L, table=kind)
    own = dispatch.own_decode_config(qn, qp, ckv, kpe)
    swap = dispatch._config(qn, ckv, False, "swapab")
    ns = D.num_splits(B, H, L, qn.device, swap)
    row.update(auto_kernel=own.kernel, auto_splits=D.num_splits(B, H, L, qn.device, own), swapab_splits=ns)

    def decode(cfg, splits=None):
        return lambda: D.decode(qn, qp, ckv, kpe, table, lens, scale, cfg=cfg, splits=splits)

    ours = decode(own)()
    got = decode(swap)()
    want = BO.reference_row(qn, qp, ckv, kpe, table, L, scale)
    row["swapab_err_out"], row["swapab_err_lse"] = BO.attention_errors(got[0][0], got[1][0], *want)
    row["swapab_vs_auto_out"], row["swapab_vs_auto_lse"] = BO.attention_errors(*got, *ours)
    row["check"] = "ok" if row["swapab_err_out"] <= BO.OUT_TOL and row["swapab_err_lse"] <= BO.LSE_TOL else "FAILED"
    times = {"auto": BO.ms(decode(own), graph=True), f"swapab@{ns}": BO.ms(decode(swap), graph=True)}
    for n, warps in tilings:
        cfg = dataclasses.replace(swap, block_h=n, num_warps=warps)
        got_t = decode(cfg)()
        row[f"swapab_N{n}_err_out"], row[f"swapab_N{n}_err_lse"] = BO.attention_errors(got_t[0][0], got_t[1][0], *want)
        if max(row[f"swapab_N{n}_err_out"] / BO.OUT_TOL, row[f"swapab_N{n}_err_lse"] / BO.LSE_TOL) > 1:
            row["check"] = "FAILED"
        times[f"swapab N{n}"] = BO.ms(decode(cfg), graph=True)
    if kind != "pages":  # the kernel auto ran on token tables before (Triton's pointer kernel)
        times["triton"] = BO.ms(decode(dispatch._config(qn, ckv, False, "triton")), graph=True)
    for s in scales:
        n = max(1, round(ns * s))
        if f"swapab@{n}" not in times:
            times[f"swapab@{n}"] = BO.ms(decode(swap, n), graph=True)
    # (FlashMLA takes pages of 64)
    times.update(BO.peer_graph_times(row, qn, qp, ckv, kpe, table, lens, scale, flashmla=kind == "pages"))
    row["us"] = {k: v * 1e3 for k, v in times.items()}
    row["bw_frac"] = {k: nbytes / (v * 1e-3) / copy_bw for k, v in times.items()}
    best_swap = min(v for k, v in times.items() if k.startswith("swapab"))
    peers = [times[k] for k in ("flashinfer", "flashmla") if k in times]
    row["swapab_vs_auto"] = times[f"swapab@{ns}"] / times["auto"]
    row["best_swapab_vs_auto"] = best_swap / times["auto"]
    if peers:
        row["swapab_vs_best_peer"] = times[f"swapab@{ns}"] / min(peers)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="swapab.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="H:B:KV")
    ap.add_argument("--splits-scale", nargs="*", type=float, default=[0.5, 2.0])
    ap.add_argument("--table", nargs="+", default=["pages"], choices=["pages", "runs", "shuffled"])
    ap.add_argument("--tiling", nargs="*", default=[], help="N:warps builds timed beside the default, e.g. 64:8")
    args = ap.parse_args()
    copy_bw = BO.copy_bandwidth()
    results = BO.probe_results(copy_bw)
    for spec in args.shapes:
        H, B, L = map(int, spec.split(":"))
        for kind in args.table:
            tilings = [tuple(map(int, t.split(":"))) for t in args.tiling]
            BO.record_row(results, lambda: run_shape(H, B, L, args.splits_scale, copy_bw, kind, tilings), H=H, B=B,
                          L=L, table=kind)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
