"""Lab probe (issue 29): split-KV decode in ONE launch, the last program of each (request, head block) merging the
splits' partials, against the product's two launches (stage 1 + `merge._merge_kernel`).

The question: an eager `mla.decode` pays two launches on the host (~5-8 us each on the H200 host, about a sixth of
its host time); a single launch would cut one, but the merge then runs in one program per (request, head block)
instead of across many, after the last split of that block arrives. Does the GPU time stay within noise (graph
replay), at the split count the policy picks and at fewer splits, and how much host time does the launch save?

The kernel: the product's pointer stage 1 (kernels/decode_stage1.py's `_attend_range`: paged, bf16, one query token), then
a barrier, one acq_rel atomic increment of the block's arrival counter (int32, zero between calls: the last arrival
resets it), and in the last arrival an online merge over the splits' partials (read with .cg loads: L2, never a
stale L1 line). Partials are float32 as in the product.

    python benchmarks/lab/one_launch_decode.py OUT.json [--shapes B:KV ...] [--heads 16]    (GPU: check, then time)
    TRITON_INTERPRET=1 python benchmarks/lab/one_launch_decode.py --check-only              (CPU: the check alone)
    bash benchmarks/device.sh onelaunch

Per shape: max error of out / lse against float64 (both paths), CUDA-graph replay medians (do_bench_cudagraph) of
the two-launch plan and the one-launch kernel at the policy's split count and at a quarter of it, and host us per
eager call of each (the plan call alone, no op dispatcher: the difference is the launch).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from mla_compile.kernels import decode as D  # noqa: E402
from mla_compile.kernels._launch import bind  # noqa: E402
from mla_compile.kernels._util import cdiv, dot_mode  # noqa: E402
from mla_compile.kernels.decode_stage1 import _attend_range, _program_tokens, _store_split  # noqa: E402

R, P, PS = 512, 64, 64
SCALE = 192 ** -0.5


@triton.jit
def _one_launch_kernel(Qn, Qp, Ckv, Kpe, Table, Lens, O, L, Out, Lse, Count,
                       scale_log2, H,
                       s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb,
                       s_on, s_ob, s_oh, s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb, s_lseh,
                       n_splits,
                       PS: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, RH: tl.constexpr, BLOCK_P: tl.constexpr,
                       DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    b, offs_h, mask_h, split, limit, start, end = _program_tokens(Lens, H, 0, 1, H, 0, 0, 0, n_splits, False, False,
                                                                  BLOCK_H, BLOCK_N)
    m_i, l_i, acc0, acc1 = _attend_range(Qn, Qp, Ckv, Kpe, Table, Lens, scale_log2, b, offs_h, mask_h, limit, start,
                                         end, s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, 0, 0, False,
                                         PS, R, P, BLOCK_H, BLOCK_N, RH, BLOCK_P, DOT_PREC, DOT_UPCAST, False, False)
    _store_split(O, L, split, b, offs_h, mask_h, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, R, m_i, l_i, acc0, acc1, RH)
    # every thread's partial stores issued before the arrival is published (the release is cumulative over them)
    tl.debug_barrier()
    counter = Count + b * tl.num_programs(1) + tl.program_id(1)
    arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    if arrived == n_splits - 1:  # the last split of this (request, head block): merge them all
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next call / graph replay
        offs_r = tl.arange(0, RH)[None, :]
        m = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        out0 = tl.zeros([BLOCK_H, RH], tl.float32)
        out1 = tl.zeros([BLOCK_H, RH], tl.float32)
        l_ptr = L + b * s_lb + offs_h * s_lh
        o_ptr = O + b * s_ob + offs_h[:, None] * s_oh + offs_r
        for _ in range(0, n_splits):  # pointers advanced per split (64-bit: s_on * splits may pass 2^31)
            lse = tl.load(l_ptr, mask=mask_h, other=float("-inf"), cache_modifier=".cg")
            ok = lse > float("-inf")
            m_new = tl.maximum(m, lse)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m - m_use)
            w = tl.where(ok, tl.exp(lse - m_use), 0.0)
            rows = (mask_h & ok)[:, None]
            o0 = tl.load(o_ptr, mask=rows, other=0.0, cache_modifier=".cg")
            o1 = tl.load(o_ptr + RH, mask=rows, other=0.0, cache_modifier=".cg")
            out0 = out0 * alpha[:, None] + w[:, None] * o0
            out1 = out1 * alpha[:, None] + w[:, None] * o1
            total = total * alpha + w
            m = m_new
            l_ptr += s_ln
            o_ptr += s_on
        inv = 1.0 / tl.where(total > 0, total, 1.0)
        out_ptr = Out + b * s_outb + offs_h[:, None] * s_outh + offs_r
        tl.store(out_ptr, (out0 * inv[:, None]).to(Out.dtype.element_ty), mask=mask_h[:, None])
        tl.store(out_ptr + RH, (out1 * inv[:, None]).to(Out.dtype.element_ty), mask=mask_h[:, None])
        tl.store(Lse + b * s_lseb + offs_h * s_lseh, tl.where(total > 0, m + tl.log(total), float("-inf")),
                 mask=mask_h)


def one_launch_plan(qn, qp, ckv, kpe, table, lens, splits: int | None = None):
    """`run(qn, qp, ckv, kpe, table, lens)` -> (out, lse) in one launch, with the product's pointer tiling and split
    policy (`splits` forces a count); its partials and counters allocated once here."""
    B, H, _ = qn.shape
    cfg = D.default_config(H, R, PS, qn.dtype)
    cfg = D.DecodeConfig(block_h=cfg.block_h, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                         max_splits=cfg.max_splits)  # the pointer kernel (no TMA): the one this probe extends
    ns = splits or D.num_splits(B, H, table.shape[1] * PS, qn.device, cfg, R)
    o = torch.empty((ns, B, H, R), dtype=torch.float32, device=qn.device)
    l = torch.empty((ns, B, H), dtype=torch.float32, device=qn.device)
    count = torch.zeros(B * cdiv(H, cfg.block_h), dtype=torch.int32, device=qn.device)
    bound = bind(_one_launch_kernel, (B, cdiv(H, cfg.block_h), ns), PS=PS, R=R, P=P, BLOCK_H=cfg.block_h,
                 BLOCK_N=cfg.block_n, RH=R // 2, BLOCK_P=P, **dot_mode(qn.dtype), num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)
    numbers = (SCALE * 1.4426950408889634, H, qn.stride(0), qn.stride(1), qp.stride(0), qp.stride(1), ckv.stride(0),
               ckv.stride(1), kpe.stride(0), kpe.stride(1), table.stride(0), o.stride(0), o.stride(1), o.stride(2),
               l.stride(0), l.stride(1), l.stride(2), H * R, R, H, 1, ns)
    lse_shape, device = (B, H), qn.device

    def run(qn, qp, ckv, kpe, table, lens):
        out = torch.empty_like(qn)
        lse = torch.empty(lse_shape, dtype=torch.float32, device=device)
        bound(qn, qp, ckv, kpe, table, lens, o, l, out, lse, count, *numbers)
        return out, lse

    return run, ns, cfg


def two_launch_plan(qn, qp, ckv, kpe, table, lens, cfg, splits: int):
    """The product's plan (stage 1 + merge) at the same tiling and split count."""
    return D.decode_plan(qn, qp, ckv, kpe, table, lens, SCALE, cfg=cfg, splits=splits).run


def reference(qn, qp, ckv, kpe, table, lens):
    """float64 (out [B, H, R], lse [B, H]) over each request's first lens[b] tokens through the block table."""
    outs, lses = [], []
    for b in range(qn.shape[0]):
        n = int(lens[b])
        slots = table[b].long().repeat_interleave(PS)[:n] * PS + torch.arange(n, device=qn.device) % PS
        c, k = ckv.reshape(-1, R)[slots].double(), kpe.reshape(-1, P)[slots].double()
        s = SCALE * (qn[b].double() @ c.T + qp[b].double() @ k.T)
        if n == 0:
            outs.append(torch.zeros(qn.shape[1], R, dtype=torch.float64, device=qn.device))
            lses.append(torch.full((qn.shape[1],), float("-inf"), dtype=torch.float64, device=qn.device))
            continue
        outs.append(torch.softmax(s, -1) @ c)
        lses.append(torch.logsumexp(s, -1))
    return torch.stack(outs), torch.stack(lses)


def errors(got, want) -> tuple[float, float]:
    out, lse = got
    w_out, w_lse = want
    finite = torch.isfinite(w_lse)
    e_out = float((out.double() - w_out).abs().max() / w_out.abs().max().clamp_min(1e-30))
    e_lse = float((lse.double()[finite] - w_lse[finite]).abs().max()) if finite.any() else 0.0
    same_empty = bool(torch.equal(torch.isfinite(lse), finite))
    return e_out, e_lse if same_empty else float("inf")


def problem(B: int, kv: int, H: int, device, lens=None, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    pages = B * cdiv(kv, PS)
    ckv = torch.randn(pages, PS, R, dtype=torch.bfloat16, device=device, generator=g)
    kpe = torch.randn(pages, PS, P, dtype=torch.bfloat16, device=device, generator=g)
    table = torch.randperm(pages, device=device, generator=g).view(B, -1).int()
    lens = torch.full((B,), kv, dtype=torch.int32, device=device) if lens is None else lens.to(device)
    qn = torch.randn(B, H, R, dtype=torch.bfloat16, device=device, generator=g)
    qp = torch.randn(B, H, P, dtype=torch.bfloat16, device=device, generator=g)
    return qn, qp, ckv, kpe, table, lens


def check(device) -> list[dict]:
    """Both paths against float64 on lengths off the tile edges, an empty request and a one-token one, several
    split counts (a counter zeroed by each call: every case runs twice on the same plan)."""
    rows = []
    cases = [(3, 300, 16, [300, 0, 1], None), (2, 1024, 16, None, None), (2, 640, 32, [640, 577], 3),
             (1, 256, 16, None, 4)]
    for B, kv, H, lens, splits in cases:
        lens_t = None if lens is None else torch.tensor(lens, dtype=torch.int32)
        qn, qp, ckv, kpe, table, lens_d = problem(B, kv, H, device, lens_t)
        want = reference(qn, qp, ckv, kpe, table, lens_d)
        run, ns, cfg = one_launch_plan(qn, qp, ckv, kpe, table, lens_d, splits)
        two = two_launch_plan(qn, qp, ckv, kpe, table, lens_d, cfg, ns)
        for _ in range(2):
            e1 = errors(run(qn, qp, ckv, kpe, table, lens_d), want)
        e2 = errors(two(qn, qp, ckv, kpe, table, lens_d, None), want)
        ok = e1[0] < 2e-2 and e1[1] < 1e-3 and e2[0] < 2e-2 and e2[1] < 1e-3
        rows.append(dict(B=B, kv=kv, H=H, lens=lens, splits=ns, one_err=e1, two_err=e2, ok=ok))
        print(f"check B {B} kv {kv} H {H} lens {lens} splits {ns}: one {e1} two {e2} {'ok' if ok else 'FAILED'}")
    return rows


def host_us(fn, calls: int = 500) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return t


def bench(shapes, heads) -> list[dict]:
    from triton.testing import do_bench_cudagraph

    rows = []
    for H in heads:
        for B, kv in shapes:
            args = problem(B, kv, H, "cuda")
            want = reference(*[a[:1] if i in (0, 1, 4, 5) else a for i, a in enumerate(args)])
            base = one_launch_plan(*args)[1]
            for ns in sorted({base, max(1, base // 4)}, reverse=True):
                run, ns, cfg = one_launch_plan(*args, splits=ns)
                two = two_launch_plan(*args, cfg, ns)
                one_call, two_call = (lambda: run(*args)), (lambda: two(*args, None))
                row = dict(H=H, B=B, kv=kv, splits=ns, policy_splits=base,
                           one_err=errors([t[:1] for t in one_call()], want),
                           two_err=errors([t[:1] for t in two_call()], want),
                           two_graph_us=1e3 * do_bench_cudagraph(two_call, rep=50, return_mode="median"),
                           one_graph_us=1e3 * do_bench_cudagraph(one_call, rep=50, return_mode="median"))
                row["two_host_us"], row["one_host_us"] = host_us(two_call), host_us(one_call)
                rows.append(row)
                print(json.dumps(row))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=["1:1024", "1:8192", "1:32768", "8:1024", "8:8192", "8:32768",
                                                    "32:8192", "32:32768"])
    ap.add_argument("--heads", nargs="*", type=int, default=[16])
    a = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("no GPU: run the check under TRITON_INTERPRET=1")
        return 2
    res = {"provenance": f"cuda: {torch.cuda.get_device_name()}" if device == "cuda" else "cpu (interpreter)",
           "check": check(device)}
    if device == "cuda" and not a.check_only:
        res["bench"] = bench([tuple(int(x) for x in s.split(":")) for s in a.shapes], a.heads)
    if a.out:
        a.out.write_text(json.dumps(res, indent=1))
    return 0 if all(r["ok"] for r in res["check"]) else 1


if __name__ == "__main__":
    sys.exit(main())
