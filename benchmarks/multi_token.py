"""Multi-token decode cost (MTP / speculative verification): `mla::decode` with S query tokens per request vs S = 1.

    python benchmarks/multi_token.py [out.json]

Shapes (issue 27's acceptance): B 8, kv 32K per request, R 512 / P 64, page 64, bf16, H 16 and H 128; S 1, 2, 4.
Timing: CUDA-graph replay (triton.testing.do_bench_cudagraph, median) of one `torch.ops.mla.decode` call, what a
captured decode step runs. S = 1 is the production one-token call (H 128: the Gluon / FlashMLA kernel the dispatch
picks); `s1_pointer_ms` also times the Triton pointer kernel at its multi-token tiling with one token, and for S > 1
`kernel` names what auto runs (a Gluon kernel from 32 rows on an H200) and `pointer_ms` / `wgmma_ms` time the pointer
kernel and decode_wgmma's TMA kernel asked for on the same call, side by side. Acceptance targets: H 16 S 2 <= 1.10x, S 4 <=
1.30x; H 128 S 2 <= 1.9x (`ratio` = ms / the S = 1 call's ms). Every timed call is checked against a float64
reference of request 0 first (`check`). Prints one JSON document (also written to argv[1] if given).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from op_timing_out import emit, row_done  # noqa: E402

import mla_compile  # noqa: F401  (registers the ops)
from mla_compile import tuning
from mla_compile.kernels import decode as D
from mla_compile.kernels import dispatch

R, P, PS, B, KV = 512, 64, 64, 8, 32768
SCALE = (128 + 64) ** -0.5
HEADS, TOKENS = (16, 128), (1, 2, 4)


def caches(gen):
    pages = B * KV // PS
    ckv = torch.randn(pages, PS, R, generator=gen, device="cuda").to(torch.bfloat16)
    kpe = torch.randn(pages, PS, P, generator=gen, device="cuda").to(torch.bfloat16)
    table = torch.randperm(pages, generator=gen, device="cuda").view(B, KV // PS).int()
    return ckv, kpe, table, torch.full((B,), KV, dtype=torch.int32, device="cuda")


def check_request0(out, lse, qn, qp, ckv, kpe, table, S) -> str:
    """Request 0 against float64 on the GPU: query token j over its first KV - S + 1 + j tokens."""
    slots = (table[0].long()[:, None] * PS + torch.arange(PS, device="cuda")).reshape(-1)
    c, k = ckv.view(-1, R)[slots].double(), kpe.view(-1, P)[slots].double()
    q4n, q4p = qn.view(B, S, -1, R)[0].double(), qp.view(B, S, -1, P)[0].double()
    o4, l4 = out.view(B, S, -1, R)[0].double(), lse.view(B, S, -1)[0].double()
    for j in range(S):
        n = KV - S + 1 + j
        s = SCALE * (q4n[j] @ c[:n].T + q4p[j] @ k[:n].T)
        want_lse = torch.logsumexp(s, -1)
        want = torch.softmax(s, -1) @ c[:n]
        err = float((o4[j] - want).norm() / want.norm())
        lse_err = float((l4[j] - want_lse).abs().max())
        if not (err < 2e-2 and lse_err < 2e-2):
            return f"token {j}: out rel err {err:.3g}, lse abs err {lse_err:.3g}"
    return "ok"


def main(argv):
    gen = torch.Generator(device="cuda").manual_seed(0)
    ckv, kpe, table, lens = caches(gen)
    rows = []
    for H in HEADS:
        base = None
        for S in TOKENS:
            shape = (B, S, H) if S > 1 else (B, H)
            qn = torch.randn(*shape, R, generator=gen, device="cuda").to(torch.bfloat16)
            qp = torch.randn(*shape, P, generator=gen, device="cuda").to(torch.bfloat16)

            def call():
                return torch.ops.mla.decode(qn, qp, ckv, kpe, table, lens, SCALE)

            out, lse = call()
            row = dict(H=H, S=S, B=B, kv_len=KV, check=check_request0(out, lse, qn, qp, ckv, kpe, table, S),
                       ms=do_bench_cudagraph(call, rep=50, return_mode="median"))
            row["kernel"] = dispatch.decode_kernel(qn.reshape(B, -1, R), qp.reshape(B, -1, P), ckv, kpe, n_query=S,
                                                   block_table=table).name
            for name, asked in (("pointer", "triton"), ("wgmma", "wgmma")):  # the other kernels, same call
                if S == 1 or asked == row["kernel"]:
                    continue
                with tuning.use(tuning.Tuning(decode_kernel=asked)):
                    out, lse = call()
                    row[f"{name}_check"] = check_request0(out, lse, qn, qp, ckv, kpe, table, S)
                    row[f"{name}_ms"] = do_bench_cudagraph(call, rep=50, return_mode="median")
            if S == 1:
                base = row["ms"]
                cfg = D.multi_token_config(H, PS, torch.bfloat16)
                row["s1_pointer_ms"] = do_bench_cudagraph(
                    lambda: D.decode(qn, qp, ckv, kpe, table, lens, SCALE, cfg=cfg), rep=50, return_mode="median")
            row["ratio"] = row["ms"] / base
            rows.append(row)
            row_done(row)
    emit(dict(device=torch.cuda.get_device_name(), rows=rows), argv)


if __name__ == "__main__":
    main(sys.argv[1:])
