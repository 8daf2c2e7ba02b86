"""Lab probe of the many-head seesaw kernel (mla_compile/kernels/decode_seesaw.py: its design is explained there) with
half-size tiles and two sets of tile slots. Question: the product kernel holds q and ONE pair of 64-token tiles in
shared memory, so each pair's second tile (slot B) frees only when the pair's last MMAs finish and is needed again
by the next pair's first scores: every pair waits for one tile's copy (timing probes: 23-26% of stage 1 at H 128,
B >= 8; benchmarks/lab/README.md). With 32-token tiles the same bytes hold TWO pairs: the next pair's tiles load
while this pair computes (a full double buffer), for twice the softmax / barrier steps per token. Does that win?

    python benchmarks/lab/seesaw_n32.py OUT.json [--shapes H:B:KV ...] [--variants 32:2 64:1]
    SEESAW_ARGS="..." bash benchmarks/device.sh seesaw

A variant "BN:NSETS" is the product kernel built with BN-token tiles and NSETS sets of (A, B) slots
(decode_seesaw.TILE_N / SLOT_SETS; "64:1" is today's build, timed again as a control). Per shape (the same data for
every column): each variant's request 0 (a partial last tile) against float64 and the whole batch against today's
kernel (out, lse), then CUDA-graph replay medians (do_bench_cudagraph) side by side: auto's kernel, today's seesaw,
each variant (stage 1 + the merge, at the policy's split count), FlashInfer's `run` (planned outside the graph) and
FlashMLA alone when they import.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_ops' helpers

import bench_ops as BO  # noqa: E402
from mla_compile.kernels import decode as D  # noqa: E402
from mla_compile.kernels import decode_seesaw as S  # noqa: E402
from mla_compile.kernels import dispatch  # noqa: E402

SHAPES = ("128:1:32768", "128:1:131072", "128:8:8192", "128:8:32768", "128:32:8192", "128:32:32768",
          "128:128:8192", "128:128:32768")


@contextlib.contextmanager
def tiling(BN: int, NSETS: int):
    """decode_seesaw's tile height and slot sets for the plans made inside (read when a plan is made)."""
    was = S.TILE_N, S.SLOT_SETS
    S.TILE_N, S.SLOT_SETS = BN, NSETS
    try:
        yield
    finally:
        S.TILE_N, S.SLOT_SETS = was


def aot(BN: int, NSETS: int, multi: bool = False) -> dict:
    """The variant compiled for sm_90a without a GPU (tools/aot.py): shared bytes, registers, spills, advisories."""
    sys.path.insert(0, str(ROOT))
    from tools import aot as A

    with tiling(BN, NSETS):
        return A.wgmma_stage1_sm90(kernel="seesaw", multi=multi)


def variant_plan(qn, qp, ckv, kpe, table, lens, scale, BN: int, NSETS: int, n_query: int = 1):
    """The product's seesaw plan (split count, partials, merge) with this tiling."""
    cfg = dispatch._config(qn, ckv, n_query > 1, "seesaw")
    with tiling(BN, NSETS):
        plan = D.decode_plan(qn, qp, ckv, kpe, table, lens, scale, cfg=cfg, n_query=n_query)
    assert plan.kind == "seesaw", plan.kind
    return plan


def check_multi(variants) -> dict:
    """Several query tokens per request (MULTI: rows j * H + h, a causal limit per row; 64 heads x 2 tokens, lengths
    that end mid-tile): each variant against float64 for every request, and against today's build."""
    R, P, DT = BO.R, BO.P, BO.DT
    B, H, S, L = 3, 64, 2, 2048
    scale = 192 ** -0.5
    ckv = torch.empty(B * L // BO.PS, BO.PS, R, dtype=DT, device="cuda").normal_()
    kpe = torch.empty(B * L // BO.PS, BO.PS, P, dtype=DT, device="cuda").normal_()
    table = torch.randperm(B * L // BO.PS, device="cuda").to(torch.int32).view(B, L // BO.PS)
    lens = torch.tensor([L, L - 37, 61], dtype=torch.int32, device="cuda")
    qn = torch.randn(B, S * H, R, dtype=DT, device="cuda")
    qp = torch.randn(B, S * H, P, dtype=DT, device="cuda")
    today = variant_plan(qn, qp, ckv, kpe, table, lens, scale, 64, 1, n_query=S)(qn, qp, ckv, kpe, table, lens)
    out = {}
    for spec in variants:
        BN, NSETS = map(int, spec.split(":"))
        got = variant_plan(qn, qp, ckv, kpe, table, lens, scale, BN, NSETS, n_query=S)(qn, qp, ckv, kpe, table, lens)
        err_o, err_l = 0.0, 0.0
        for b in range(B):
            for j in range(S):
                n = int(lens[b]) - S + 1 + j
                rows = slice(j * H, (j + 1) * H)
                want = BO.reference_row(qn[:, rows], qp[:, rows], ckv, kpe, table, n, scale, b)
                eo, el = BO.attention_errors(got[0][b, rows], got[1][b, rows], *want)
                err_o, err_l = max(err_o, eo), max(err_l, el)
        vs = BO.attention_errors(*got, *today)
        ok = err_o <= BO.OUT_TOL and err_l <= BO.LSE_TOL and vs[0] <= BO.OUT_TOL and vs[1] <= BO.LSE_TOL
        out[spec] = dict(err_out=err_o, err_lse=err_l, vs_today_out=vs[0], vs_today_lse=vs[1],
                         check="ok" if ok else "FAILED")
    return out


def run_shape(H: int, B: int, L: int, variants, copy_bw: float) -> dict:
    R, P = BO.R, BO.P
    scale = 192 ** -0.5
    qn, qp, ckv, kpe, table, lens = BO.shuffled_pages_case(H, B, L)
    row = dict(H=H, B=B, L=L)
    seesaw = dispatch._config(qn, ckv, False, "seesaw")
    own = dispatch.own_decode_config(qn, qp, ckv, kpe)
    row.update(auto_kernel=own.kernel, splits=D.num_splits(B, H, L, qn.device, seesaw))

    def product(cfg):
        return lambda: D.decode(qn, qp, ckv, kpe, table, lens, scale, cfg=cfg)

    ref = product(seesaw)()
    want = BO.reference_row(qn, qp, ckv, kpe, table, int(lens[0]), scale)
    times = {"auto": BO.ms(product(own), graph=True), "seesaw": BO.ms(product(seesaw), graph=True)}
    row["check"] = "ok"
    for spec in variants:
        BN, NSETS = map(int, spec.split(":"))
        name = f"v{BN}x{NSETS}"
        plan = variant_plan(qn, qp, ckv, kpe, table, lens, scale, BN, NSETS)
        got = plan(qn, qp, ckv, kpe, table, lens)
        row[f"{name}_err_out"], row[f"{name}_err_lse"] = BO.attention_errors(got[0][0], got[1][0], *want)
        row[f"{name}_vs_seesaw_out"], row[f"{name}_vs_seesaw_lse"] = BO.attention_errors(*got, *ref)
        if row[f"{name}_err_out"] > BO.OUT_TOL or row[f"{name}_err_lse"] > BO.LSE_TOL or \
                row[f"{name}_vs_seesaw_out"] > BO.OUT_TOL or row[f"{name}_vs_seesaw_lse"] > BO.LSE_TOL:
            row["check"] = "FAILED"
        times[name] = BO.ms(lambda: plan(qn, qp, ckv, kpe, table, lens), graph=True)
    times.update(BO.peer_graph_times(row, qn, qp, ckv, kpe, table, lens, scale))
    row["us"] = {k: round(v * 1e3, 2) for k, v in times.items()}
    flops = D.flops(B, H, L, R, P)
    row["tflops"] = {k: round(flops / (v * 1e-3) / 1e12, 1) for k, v in times.items()}
    row["vs_best_peer"] = BO.ratios_to_best_peer(times)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="seesaw_n32.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="H:B:KV")
    ap.add_argument("--variants", nargs="+", default=["32:2", "64:1"], help="BN:NSETS")
    args = ap.parse_args()
    copy_bw = BO.copy_bandwidth()
    results = BO.probe_results(copy_bw)
    try:
        results["multi_token_check"] = check_multi(args.variants)
    except Exception as e:  # report, keep going
        results["multi_token_check"] = dict(error=repr(e)[:800])
    print(json.dumps(dict(multi_token_check=results["multi_token_check"])), flush=True)
    for spec in args.shapes:
        H, B, L = map(int, spec.split(":"))
        BO.record_row(results, lambda: run_shape(H, B, L, args.variants, copy_bw), H=H, B=B, L=L)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
