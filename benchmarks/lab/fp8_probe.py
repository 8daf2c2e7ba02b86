"""Lab probe (issue 25): where the FP8 stage-1 kernel's time goes at few heads, and whether fp16 MMAs help.

    python benchmarks/lab/fp8_probe.py [out.json]

A copy of `kernels/decode_fp8._stage1_fp8_kernel` with two switches, timed by CUDA-graph replay through
`kernels/decode.decode` (the product's plan and merge; the probe kernel swapped in) next to the product kernel and
the bf16 cache's decode, same tokens (benchmarks/fp8_decode.py's caches):

- F16: the e4m3 tiles converted to fp16 (one cvt.rn.f16x2.e4m3x2 per two values; bf16 needs a second, per-value
  cvt.bf16.f16 on sm_90, sm_90a PTX of the product kernel), q converted to fp16 after a power-of-two prescale per
  row (no overflow), p x scale / (the tile's largest scale) in fp16 with the largest scale applied in fp32 after
  the MMA (no underflow of p x scale); the rope product stays bf16.
- DROP: 0 the whole kernel; 1 without p.ckv; 2 without the latent part of q.ckv^T; 3 without both (timing only:
  wrong results).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mla_compile.kernels._util import mma, pdl_enter  # noqa: E402
from mla_compile.kernels.decode_stage1 import _program_tokens, _split_norm, _tile_mask, _tile_slots  # noqa: E402


@triton.jit
def _scores(s, Ckv, Scale, rows, srow, valid, qg, g: tl.constexpr, F16: tl.constexpr, DROP: tl.constexpr,
            DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    c = tl.load(Ckv + rows[:, None] + g * 128 + tl.arange(0, 128)[None, :], mask=valid[:, None], other=0.0)
    sg = tl.load(Scale + srow + g, mask=valid, other=0.0)[None, :]
    if DROP != 2 and DROP != 3:
        s = s + mma(qg, tl.trans(c.to(qg.dtype)), tl.zeros(s.shape, tl.float32), DOT_PREC, DOT_UPCAST) * sg
    return s, sg


@triton.jit
def _values(acc, Ckv, rows, valid, p, sg, alpha, g: tl.constexpr, F16: tl.constexpr, DROP: tl.constexpr,
            DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    if DROP == 1 or DROP == 3:
        return acc
    c = tl.load((Ckv + g * 128) + (tl.arange(0, 128)[None, :] + rows[:, None]), mask=valid[:, None], other=0.0)
    if F16:
        smax = tl.max(sg, 1)  # [1]
        smax = tl.where(smax > 0, smax, 1.0)
        pv = mma((p * (sg / smax[:, None])).to(tl.float16), c.to(tl.float16), tl.zeros(acc.shape, tl.float32),
                 DOT_PREC, DOT_UPCAST)
        return acc * alpha[:, None] + pv * smax[:, None]
    else:
        return mma((p * sg).to(tl.bfloat16), c.to(tl.bfloat16), acc * alpha[:, None], DOT_PREC, DOT_UPCAST)


@triton.jit
def _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, qs, g: tl.constexpr, F16: tl.constexpr):
    offs = g * 128 + tl.arange(0, 128)[None, :]
    q = tl.load(Qn + b * s_qnb + offs_h[:, None] * s_qnh + offs, mask=mask_h[:, None], other=0.0)
    if F16:
        q = (q.to(tl.float32) * qs[:, None]).to(tl.float16)
    return q


@triton.jit
def _row_amax(Qn, b, offs_h, mask_h, s_qnb, s_qnh, G: tl.constexpr):
    offs = tl.arange(0, 128 * G)[None, :]
    q = tl.load(Qn + b * s_qnb + offs_h[:, None] * s_qnh + offs, mask=mask_h[:, None], other=0.0)
    return tl.max(tl.abs(q.to(tl.float32)), 1)


@triton.jit
def _probe_kernel(Qn, Qp, Ckv, Kpe, Table, Lens, O, L, Scale,
                  scale_log2, H, n_sparse,
                  s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss,
                  s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                  n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                  SPARSE: tl.constexpr, PS: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                  DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, MULTI: tl.constexpr = False,
                  PDL: tl.constexpr = False, F16: tl.constexpr = False, DROP: tl.constexpr = 0):
    pdl_enter(PDL)
    b, offs_h, mask_h, split, limit, start, end = _program_tokens(Lens, H, n_sparse, n_query, heads_per_query, s_lenb,
                                                                  s_lenq, causal, n_splits, SPARSE, MULTI, BLOCK_H,
                                                                  BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)[None, :]
    qp = tl.load(Qp + b * s_qpb + offs_h[:, None] * s_qph + offs_p, mask=mask_h[:, None] & (offs_p < P), other=0.0)
    if F16:  # power-of-two prescale per row: |q| * qs < 2^14, exact
        amax = _row_amax(Qn, b, offs_h, mask_h, s_qnb, s_qnh, G)
        e = tl.maximum(tl.ceil(tl.log2(tl.maximum(amax, 1e-30))) - 14.0, 0.0)
        qs = tl.exp2(-e)
        unscale = tl.exp2(e)
    else:
        qs = tl.full([BLOCK_H], 1.0, tl.float32)
        unscale = qs
    q0 = _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, qs, 0, F16)
    q1 = _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, qs, 1, F16)
    q2 = _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, qs, 2, F16)
    q3 = _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, qs, 3, F16)
    a0 = tl.zeros([BLOCK_H, 128], tl.float32)
    a1 = tl.zeros([BLOCK_H, 128], tl.float32)
    a2 = tl.zeros([BLOCK_H, 128], tl.float32)
    a3 = tl.zeros([BLOCK_H, 128], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        page, off, valid = _tile_slots(Table, b, s_tb, offs_t, end, SPARSE, PS)
        rows = page * s_cp + off * s_cs
        srow = page * s_sp + off * s_ss
        k = tl.load(Kpe + (page * s_kp + off * s_ks)[:, None] + offs_p, mask=valid[:, None] & (offs_p < P), other=0.0)
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        s, s0 = _scores(s, Ckv, Scale, rows, srow, valid, q0, 0, F16, DROP, DOT_PREC, DOT_UPCAST)
        s, s1 = _scores(s, Ckv, Scale, rows, srow, valid, q1, 1, F16, DROP, DOT_PREC, DOT_UPCAST)
        s, s2 = _scores(s, Ckv, Scale, rows, srow, valid, q2, 2, F16, DROP, DOT_PREC, DOT_UPCAST)
        s, s3 = _scores(s, Ckv, Scale, rows, srow, valid, q3, 3, F16, DROP, DOT_PREC, DOT_UPCAST)
        s = s * unscale[:, None] + mma(qp, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_PREC,
                                       DOT_UPCAST)
        s = tl.where(_tile_mask(valid, offs_t, limit, MULTI), s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        a0 = _values(a0, Ckv, rows, valid, p, s0, alpha, 0, F16, DROP, DOT_PREC, DOT_UPCAST)
        a1 = _values(a1, Ckv, rows, valid, p, s1, alpha, 1, F16, DROP, DOT_PREC, DOT_UPCAST)
        a2 = _values(a2, Ckv, rows, valid, p, s2, alpha, 2, F16, DROP, DOT_PREC, DOT_UPCAST)
        a3 = _values(a3, Ckv, rows, valid, p, s3, alpha, 3, F16, DROP, DOT_PREC, DOT_UPCAST)
    inv, lse = _split_norm(m_i, l_i)
    o_row = split.to(tl.int64) * s_on + b * s_ob + offs_h[:, None] * s_oh
    offs = tl.arange(0, 128)[None, :]
    tl.store(O + o_row + offs, a0 * inv[:, None], mask=mask_h[:, None])
    tl.store(O + o_row + 128 + offs, a1 * inv[:, None], mask=mask_h[:, None])
    tl.store(O + o_row + 256 + offs, a2 * inv[:, None], mask=mask_h[:, None])
    tl.store(O + o_row + 384 + offs, a3 * inv[:, None], mask=mask_h[:, None])
    tl.store(L + split * s_ln + b * s_lb + offs_h * s_lh, lse, mask=mask_h)


VARIANTS = {"bf16": dict(F16=False, DROP=0), "f16": dict(F16=True, DROP=0), "f16_no_pv": dict(F16=True, DROP=1),
            "f16_no_qk": dict(F16=True, DROP=2), "f16_no_both": dict(F16=True, DROP=3),
            "f16_n32": dict(F16=True, DROP=0, BLOCK_N=32), "f16_h32n32": dict(F16=True, DROP=0, BLOCK_N=32, BLOCK_H=32)}
CASES = [(16, 8, 32768), (16, 32, 32768), (128, 8, 32768)]


def main(argv):
    from unittest import mock

    from triton.testing import do_bench_cudagraph

    import fp8_decode as FD
    from mla_compile.kernels import decode as K
    from mla_compile.kernels import decode_fp8

    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for H, B, KV in CASES:
        ckv, kpe, (c8, s8, k8), table, lens = FD.caches(B, KV, gen)
        qn = torch.randn(B, H, 512, generator=gen, device="cuda").to(torch.bfloat16)
        qp = torch.randn(B, H, 64, generator=gen, device="cuda").to(torch.bfloat16)
        row = dict(H=H, B=B, kv_len=KV)
        torch.cuda.synchronize()
        row["bf16_cache_ms"] = do_bench_cudagraph(lambda: torch.ops.mla.decode(qn, qp, ckv, kpe, table, lens,
                                                                               FD.SCALE), rep=50, return_mode="median")
        call = lambda: K.decode(qn, qp, c8, k8, table, lens, FD.SCALE, ckv_scale=s8)  # noqa: E731
        row["product_ms"] = do_bench_cudagraph(call, rep=50, return_mode="median")
        want = call()[0].double()
        base = K.fp8_constexprs
        for name, flags in VARIANTS.items():
            flags = dict(flags)
            tiles = {k: flags.pop(k) for k in ("BLOCK_N", "BLOCK_H") if k in flags}
            cfg = K.DecodeConfig(block_h=tiles.get("BLOCK_H", 16), block_n=tiles.get("BLOCK_N", 64), num_warps=4,
                                 num_stages=2, max_splits=256)
            with mock.patch.object(decode_fp8, "_stage1_fp8_kernel", _probe_kernel), \
                    mock.patch.object(K, "fp8_constexprs", lambda *a, flags=flags: dict(base(*a), **flags)):
                try:
                    out = K.decode(qn, qp, c8, k8, table, lens, FD.SCALE, cfg=cfg, ckv_scale=s8)[0].double()
                    torch.cuda.synchronize()
                    row[f"{name}_rel_err_vs_product"] = float((out - want).norm() / want.norm())
                    row[f"{name}_ms"] = do_bench_cudagraph(
                        lambda: K.decode(qn, qp, c8, k8, table, lens, FD.SCALE, cfg=cfg, ckv_scale=s8), rep=50,
                        return_mode="median")
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - reported per variant
                    row[f"{name}_error"] = repr(e)[-300:]
                    print(name, row[f"{name}_error"], flush=True)
        rows.append(row)
        print(json.dumps(row), flush=True)
        del ckv, kpe, c8, s8, k8
        torch.cuda.empty_cache()
    doc = dict(device=torch.cuda.get_device_name(), rows=rows)
    if argv:
        Path(argv[0]).write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
