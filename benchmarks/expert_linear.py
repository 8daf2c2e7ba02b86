"""MoE expert products at decode: HF's batched_mm form (`bmm(W[ids], x[..., None])`: gather every pair's expert
weight, then bmm) vs `mla::expert_linear` (each pair's expert read in place), bf16.

    python benchmarks/expert_linear.py [out.json]

Shapes: the 4-layer DeepSeek-V3 of benchmarks/RESULTS.md's generate() profile (8 experts top-2, hidden 2048, moe
intermediate 1024, batch 8: gate_up [16 pairs, O 2048, I 2048], down [16, 2048, 1024]) and the real DeepSeek-V3's
(256 experts top-8, hidden 7168, moe intermediate 2048: gate_up O 4096 x I 7168, down 7168 x 2048) at batch 8 and
32. Routing: top-k of random scores per token (k distinct experts a token). Timing: CUDA-graph replay
(triton.testing.do_bench_cudagraph, median) of one call, what a captured decode step runs. `GBps` counts the bytes
of the distinct experts used (each read once would be the floor) over the op's time. Every timed result is checked
against float64 on 4 pairs first (`check`); HF's form is skipped where its gathered copy does not fit. Prints one
JSON document (also written to argv[1] if given).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from op_timing_out import emit, row_done  # noqa: E402

import mla_compile.ops.experts  # noqa: F401  (registers mla::expert_linear)

# (name, experts E, top-k, tokens B, O, I)
CASES = [("small gate_up", 8, 2, 8, 2048, 2048), ("small down", 8, 2, 8, 2048, 1024),
         ("v3 gate_up B8", 256, 8, 8, 4096, 7168), ("v3 down B8", 256, 8, 8, 7168, 2048),
         ("v3 gate_up B32", 256, 8, 32, 4096, 7168), ("v3 down B32", 256, 8, 32, 7168, 2048)]


def hf_batched_mm(x, weight, ids):
    return torch.bmm(weight[ids], x[:, :, None])[:, :, 0]


def check(y, x, weight, ids) -> str:
    for s in range(min(4, x.shape[0])):
        want = weight[ids[s]].double() @ x[s].double()
        err = float((y[s].double() - want).norm() / want.norm())
        if not err < 2e-2:
            return f"pair {s}: rel err {err:.3g}"
    return "ok"


def main(argv):
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, E, k, B, O, I in CASES:
        weight = torch.randn(E, O, I, generator=gen, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(B, E, generator=gen, device="cuda").topk(k, -1).indices.reshape(-1)
        x = torch.randn(B * k, I, generator=gen, device="cuda", dtype=torch.bfloat16)
        distinct = int(ids.unique().numel())
        row = dict(case=name, E=E, top_k=k, B=B, S=B * k, O=O, I=I, distinct_experts=distinct)
        ours = lambda: torch.ops.mla.expert_linear(x, weight, ids)  # noqa: E731
        row["check"] = check(ours(), x, weight, ids)
        row["ms"] = do_bench_cudagraph(ours, rep=50, return_mode="median")
        row["GBps"] = distinct * O * I * 2 / row["ms"] / 1e6
        try:
            row["hf_check"] = check(hf_batched_mm(x, weight, ids), x, weight, ids)
            row["hf_ms"] = do_bench_cudagraph(lambda: hf_batched_mm(x, weight, ids), rep=50, return_mode="median")
            row["speedup"] = row["hf_ms"] / row["ms"]
        except torch.OutOfMemoryError:
            row["hf_ms"] = None  # the gathered copy of every pair's weight does not fit
        rows.append(row)
        row_done(row)
        del weight
        torch.cuda.empty_cache()
    emit(dict(device=torch.cuda.get_device_name(), rows=rows), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
