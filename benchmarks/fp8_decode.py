"""FP8 latent cache decode (mla_compile/fp8.py, issue 25) vs the bf16 cache, side by side on the same tokens.

    python benchmarks/fp8_decode.py [out.json]

Shapes: (H 16, B 8), (H 16, B 32), (H 128, B 8), kv 32K per request, R 512 / P 64, page 64, bf16 q. The bf16
cache is random bf16 tokens; the FP8 cache holds the same tokens quantized by `mla::cache_write_fp8` (656 bytes a
token, one [NP, PS, 656] buffer). Timing: CUDA-graph replay (triton.testing.do_bench_cudagraph, median) of one
`torch.ops.mla.decode` call, what a captured decode step runs: the bf16 call is what the dispatch picks for
separate caches (the Triton / Gluon kernels; FlashMLA reads only a fused buffer), the FP8 call the Triton pointer
kernel's FP8 path. Every timed call is checked first against a float64 reference of request 0 (over the
dequantized cache for FP8). `fp8_speedup` = bf16 ms / FP8 ms; `*_gbps` counts the cache bytes read (bf16: 1152 a
token, FP8: 656). Prints one JSON document (also written to argv[1] if given).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from op_timing_out import emit, row_done  # noqa: E402

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile import fp8

R, P, PS, KV = 512, 64, 64, 32768
SCALE = (128 + 64) ** -0.5
CASES = [(16, 8), (16, 32), (128, 8)]  # (H, B)


def caches(B, gen):
    """(bf16 ckv, bf16 kpe, FP8 buffer views (ckv, scale, kpe), block table, lengths) of the same tokens."""
    pages = B * KV // PS
    ckv = torch.randn(pages, PS, R, generator=gen, device="cuda").to(torch.bfloat16)
    kpe = torch.randn(pages, PS, P, generator=gen, device="cuda").to(torch.bfloat16)
    _, c8, s8, k8 = fp8.allocate(pages, PS, R, P, device="cuda")
    slots = torch.arange(pages * PS, device="cuda")
    torch.ops.mla.cache_write_fp8(c8, k8, s8, ckv.view(-1, R), kpe.view(-1, P), slots)
    table = torch.randperm(pages, generator=gen, device="cuda").view(B, KV // PS).int()
    return ckv, kpe, (c8, s8, k8), table, torch.full((B,), KV, dtype=torch.int32, device="cuda")


def check_request0(out, lse, qn, qp, ckv_rows, kpe, table) -> str:
    """Request 0 against float64 on the GPU; ckv_rows(slots) gives its latent rows in float64."""
    slots = (table[0].long()[:, None] * PS + torch.arange(PS, device="cuda")).reshape(-1)
    c, k = ckv_rows(slots), kpe.reshape(-1, P)[slots].double()
    s = SCALE * (qn[0].double() @ c.T + qp[0].double() @ k.T)
    want = torch.softmax(s, -1) @ c
    err = float((out[0].double() - want).norm() / want.norm())
    lse_err = float((lse[0].double() - torch.logsumexp(s, -1)).abs().max())
    return "ok" if err < 2e-2 and lse_err < 2e-2 else f"out rel err {err:.3g}, lse abs err {lse_err:.3g}"


def main(argv):
    from triton.testing import do_bench_cudagraph

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for H, B in CASES:
        ckv, kpe, (c8, s8, k8), table, lens = caches(B, gen)
        qn = torch.randn(B, H, R, generator=gen, device="cuda").to(torch.bfloat16)
        qp = torch.randn(B, H, P, generator=gen, device="cuda").to(torch.bfloat16)

        def bf16_call():
            return torch.ops.mla.decode(qn, qp, ckv, kpe, table, lens, SCALE)

        def fp8_call():
            return torch.ops.mla.decode(qn, qp, c8, k8, table, lens, SCALE, s8)

        row = dict(H=H, B=B, kv_len=KV)
        row["bf16_check"] = check_request0(*bf16_call(), qn, qp, lambda s: ckv.view(-1, R)[s].double(), kpe, table)
        row["fp8_check"] = check_request0(
            *fp8_call(), qn, qp, lambda s: fp8.dequantize(c8.reshape(-1, R)[s], s8.reshape(-1, 4)[s], torch.float64),
            k8, table)
        o8, o16 = fp8_call()[0].double(), bf16_call()[0].double()
        row["fp8_vs_bf16_max_row_rel_err"] = float(((o8 - o16).norm(dim=-1) / o16.norm(dim=-1)).max())
        row["bf16_ms"] = do_bench_cudagraph(bf16_call, rep=50, return_mode="median")
        row["fp8_ms"] = do_bench_cudagraph(fp8_call, rep=50, return_mode="median")
        row["fp8_speedup"] = row["bf16_ms"] / row["fp8_ms"]
        tokens = B * KV
        row["bf16_gbps"] = tokens * 2 * (R + P) / row["bf16_ms"] / 1e6
        row["fp8_gbps"] = tokens * fp8.token_bytes(R, P) / row["fp8_ms"] / 1e6
        rows.append(row)
        row_done(row)
        del ckv, kpe, c8, s8, k8
        torch.cuda.empty_cache()
    doc = dict(device=torch.cuda.get_device_name(), token_bytes=dict(bf16=2 * (R + P), fp8=fp8.token_bytes(R, P)),
               rows=rows)
    emit(doc, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
