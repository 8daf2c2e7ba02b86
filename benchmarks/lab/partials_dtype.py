"""Lab probe: split-KV partial outs in bf16 instead of float32 (issue 24, the H 128 shapes FlashInfer leads).

Question: at H 128 and few tokens per call (B 1 32K-128K, B 8 8K) our seesaw kernel pays a fixed cost per call that
the per-tile rate does not explain (B 8 8K: ~62 us for 16 tiles a CTA where B 8 128K runs ~2.7 us a tile). One
candidate: the split partials. Every CTA ends by writing its 64 x 512 float32 partial out (128 KB; 16.8 MB for the
grid at B 8 8K, 8 splits) in one burst after its last tile, and the merge reads them all back: ~5-6 us each way at
HBM speed, with nothing to overlap. In bf16 they are half the bytes. What it costs in accuracy: each partial is
rounded to bf16 before the log-sum-exp merge (peers merge bf16 partials: FlashInfer's / SGLang's merge_state, vLLM's
DCP merge), so the final out carries about twice the rounding of one bf16 store.

    python benchmarks/lab/partials_dtype.py OUT.json [--shapes H:B:KV ...] [--splits-scale 0.5 2]
    PARTIALS_ARGS="..." bash benchmarks/device.sh partials

Per shape (the same data for every column): auto's own kernel (`dispatch.own_decode_config`: seesaw at H >= 64,
swap-AB below) at the policy's split count and at that count times each --splits-scale, each with float32 and with
bf16 partials (the product's plan with its scratch replaced; the kernels store through typed pointers, so they
round on the store, and the merge kernel reads either); request 0 (a partial last tile) against float64 for each;
then CUDA-graph replay medians (do_bench_cudagraph) side by side with FlashInfer's `run` (planned outside the graph)
and FlashMLA alone when they import.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))  # bench_ops' helpers

import bench_ops as BO  # noqa: E402
from mla_compile.kernels import decode as D  # noqa: E402
from mla_compile.kernels import dispatch  # noqa: E402

SHAPES = ("128:1:8192", "128:1:32768", "128:1:131072", "128:8:8192", "128:8:32768", "128:32:8192",
          "128:128:8192", "16:1:32768", "16:8:8192", "16:8:32768", "16:32:8192")


def plan_with(qn, qp, ckv, kpe, table, lens, scale, cfg, splits: int, dtype: torch.dtype):
    """The product's plan at `splits`, its partial outs in `dtype` (float32: the product as it is)."""
    plan = D.decode_plan(qn, qp, ckv, kpe, table, lens, scale, cfg=cfg, splits=splits)
    if dtype != torch.float32 and plan.ns > 1:
        o = torch.empty(plan.partial_shapes[0], dtype=dtype, device=qn.device)
        l = torch.empty(plan.partial_shapes[1], dtype=torch.float32, device=qn.device)
        plan.partials = SimpleNamespace(get=lambda: (o, l))
        plan.run = plan._runner()  # its closure reads the scratch getter
    return plan


def run_shape(H: int, B: int, L: int, scales, copy_bw: float) -> dict:
    scale = 192 ** -0.5
    qn, qp, ckv, kpe, table, lens = BO.shuffled_pages_case(H, B, L)
    own = dispatch.own_decode_config(qn, qp, ckv, kpe)
    ns = D.num_splits(B, H, L, qn.device, own)
    row = dict(H=H, B=B, L=L, kernel=own.kernel, splits=ns, check="ok")
    want = BO.reference_row(qn, qp, ckv, kpe, table, int(lens[0]), scale)
    counts = sorted({max(1, round(ns * s)) for s in (1.0, *scales)})
    times = {}
    for n in counts:
        for dtype, tag in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
            name = f"{tag}@{n}"
            plan = plan_with(qn, qp, ckv, kpe, table, lens, scale, own, n, dtype)
            got = plan(qn, qp, ckv, kpe, table, lens)
            row[f"{name}_err_out"], row[f"{name}_err_lse"] = BO.attention_errors(got[0][0], got[1][0], *want)
            if row[f"{name}_err_out"] > BO.OUT_TOL or row[f"{name}_err_lse"] > BO.LSE_TOL:
                row["check"] = "FAILED"
            times[name] = BO.ms(lambda plan=plan: plan(qn, qp, ckv, kpe, table, lens), graph=True)
    times.update(BO.peer_graph_times(row, qn, qp, ckv, kpe, table, lens, scale))
    row["us"] = {k: round(v * 1e3, 2) for k, v in times.items()}
    row["bf16_vs_f32_at_policy"] = round(times[f"bf16@{ns}"] / times[f"f32@{ns}"], 3)
    best = min((v, k) for k, v in times.items() if k.startswith("bf16"))
    row["best_bf16"] = best[1]
    row["vs_best_peer"] = BO.ratios_to_best_peer(times)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="partials_dtype.json")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="H:B:KV")
    ap.add_argument("--splits-scale", nargs="*", type=float, default=[0.5, 2.0])
    args = ap.parse_args()
    copy_bw = BO.copy_bandwidth()
    results = BO.probe_results(copy_bw)
    for spec in args.shapes:
        H, B, L = map(int, spec.split(":"))
        BO.record_row(results, lambda: run_shape(H, B, L, args.splits_scale, copy_bw), H=H, B=B, L=L)
    Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
