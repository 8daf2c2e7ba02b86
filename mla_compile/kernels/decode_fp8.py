"""The FP8 latent cache's stage-1 decode kernel (the format: mla_compile/fp8.py): the scales folded into the
products, so no tile is ever multiplied out.

A token's latent is e4m3 values k8 with one float32 scale per group of 128 channels, value = k8 * scale_g. Both
products of the decode split along the groups, and each group's scale is one number per token:

    s[h, n]       = sum_g scale_g[n] * (q_g[h] . k8_g[n])        q.ckv^T: one MMA per group, its [H, N] result scaled
    out_g[h, :]  += sum_n (p[h, n] * scale_g[n]) * k8_g[n, :]      p.ckv: p scaled per group, one MMA per group

so the only per-element work on a tile is e4m3 -> fp16 (exact: e4m3's values all fit fp16), one
`cvt.rn.f16x2.e4m3x2` per two values; bf16 would take a second, per-value `cvt.bf16.f16` on sm_90 (Triton 3.6,
sm_90a PTX: 512 more instructions per warp and 64-token tile than the 136 MMAs). The MMAs run in fp16:
- q (bf16 or fp16) is multiplied by a power of two per row so that its largest |value| lies in (2^13, 2^14] (fp16
  holds it, and a row of small values keeps fp16's full mantissa; exact where the values stay in fp16's normal
  range), and the scores by its inverse;
- p * scale_g is divided by the tile's largest scale_g (so it lies in [0, 1]: small scales do not underflow fp16)
  and that scale multiplies the fp32 product;
- the rope part (bf16 / fp16 in the cache) keeps q's dtype.
Scores are then q . stored values exactly (fp32 accumulation; no rounding of value x scale), and p carries fp16's
11-bit mantissa where the bf16 pointer kernels carry 8. fp32 q keeps the register-dequantizing pointer kernel
(decode_stage1.py, FP8: fp32 MMAs).

Grid, split ranges, block tables / index lists and per-row limits (several query tokens) are the pointer
kernel's (the shared helpers of decode_stage1.py); each split writes its normalised partial out and natural-log
lse (-inf when it holds no token)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import fp8
from ._util import mma, pdl_enter
from .decode_stage1 import _program_tokens, _split_norm, _tile_mask, _tile_slots

MAX_GROUPS = 4  # R <= 512: one accumulator of [BLOCK_H, fp8.GROUP] per group, written out (the kernels' 128)


def fits(R: int, dtype) -> bool:
    """This kernel takes an FP8 call: bf16 / fp16 q, R a multiple of 128 up to 512."""
    return dtype in (torch.bfloat16, torch.float16) and R % fp8.GROUP == 0 and 0 < R // fp8.GROUP <= MAX_GROUPS


@triton.jit
def _group_scores(s, Ckv, Scale, rows, srow, valid, qg, g: tl.constexpr, DOT_PREC: tl.constexpr,
                  DOT_UPCAST: tl.constexpr):
    """(s + scale_g[n] * (q_g . k8_g[n]), scale_g as [1, BLOCK_N]) for group g of a tile (q_g fp16, prescaled).
    Masked slots load value 0 and scale 0 (unused slots may hold NaN: never read)."""
    c = tl.load(Ckv + rows[:, None] + g * 128 + tl.arange(0, 128)[None, :], mask=valid[:, None], other=0.0)
    sg = tl.load(Scale + srow + g, mask=valid, other=0.0)[None, :]
    return s + mma(qg, tl.trans(c.to(tl.float16)), tl.zeros(s.shape, tl.float32), DOT_PREC, DOT_UPCAST) * sg, sg


@triton.jit
def _group_values(acc, Ckv, rows, valid, p, sg, alpha, g: tl.constexpr, DOT_PREC: tl.constexpr,
                  DOT_UPCAST: tl.constexpr):
    """acc * alpha + (p * scale_g) . k8_g for group g of a tile: p * scale_g / (the tile's largest scale_g) in
    fp16 (within [0, 1]: no underflow of small scales), the largest scale applied to the fp32 product.

    The group's values are loaded again here, not passed from `_group_scores`: Triton 3.6 does not pipeline a
    load with two uses (transposed for q.ckv^T, plain for p.ckv) and loads it synchronously into registers (255
    registers and spills at 64-token tiles, sm_90a); two loads of the same bytes become two async copies into
    shared memory (the second served by L2). The address is formed in another order on purpose: an identical
    load would be merged with the first."""
    c = tl.load((Ckv + g * 128) + (tl.arange(0, 128)[None, :] + rows[:, None]), mask=valid[:, None], other=0.0)
    top = tl.max(sg, 1)
    top = tl.where(top > 0, top, 1.0)[:, None]  # a tile of masked slots only: p is 0 there anyway
    pv = mma((p * (sg / top)).to(tl.float16), c.to(tl.float16), tl.zeros(acc.shape, tl.float32), DOT_PREC,
             DOT_UPCAST)
    return acc * alpha[:, None] + pv * top


@triton.jit
def _q_prescale(Qn, b, offs_h, mask_h, s_qnb, s_qnh, G: tl.constexpr):
    """(2^e, 2^-e) [BLOCK_H]: q goes to fp16 for the MMAs, each row times the power of two 2^-e that puts its
    largest |value| in (2^13, 2^14] (fp16 holds it, and a row of small values keeps fp16's full mantissa instead of
    its subnormals); the scores are multiplied back by 2^e. A row of zeros takes 2^-e = 2^114 (its values stay 0);
    NaN / inf give NaN scores. One load of the whole row (the register allocation of the loop after it spills least
    this way, sm_90a)."""
    R_BLOCK: tl.constexpr = 512 if G > 2 else 128 * G
    offs = tl.arange(0, R_BLOCK)[None, :]
    q = tl.load(Qn + b * s_qnb + offs_h[:, None] * s_qnh + offs, mask=mask_h[:, None] & (offs < 128 * G), other=0.0)
    e = tl.ceil(tl.log2(tl.maximum(tl.max(tl.abs(q.to(tl.float32)), 1), 1e-30))) - 14.0
    return tl.exp2(e), tl.exp2(-e)


@triton.jit
def _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, prescale, g: tl.constexpr):
    """Group g of q's latent part [BLOCK_H, 128] times its rows' power-of-two prescale, as fp16."""
    offs = g * 128 + tl.arange(0, 128)[None, :]
    q = tl.load(Qn + b * s_qnb + offs_h[:, None] * s_qnh + offs, mask=mask_h[:, None], other=0.0)
    return (q.to(tl.float32) * prescale[:, None]).to(tl.float16)


@triton.jit
def _store_group(O, o_row, mask_h, acc, inv, g: tl.constexpr):
    tl.store(O + o_row + g * 128 + tl.arange(0, 128)[None, :], acc * inv[:, None], mask=mask_h[:, None])


@triton.jit
def _stage1_fp8_kernel(Qn, Qp, Ckv, Kpe, Table, Lens, O, L, Scale,
                       scale_log2, H, n_sparse,
                       s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss,
                       s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                       n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                       SPARSE: tl.constexpr, PS: tl.constexpr, G: tl.constexpr, P: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
                       DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, MULTI: tl.constexpr = False,
                       PDL: tl.constexpr = False):
    """`_stage1_kernel`'s arguments and grid (decode_stage1.py) over an FP8 cache of G = R / 128 groups: Ckv the
    e4m3 values, Scale their float32 scales (strides s_sp, s_ss per page / slot, G per token), Kpe the rope part
    in q's dtype (bf16 / fp16)."""
    pdl_enter(PDL)
    b, offs_h, mask_h, split, limit, start, end = _program_tokens(Lens, H, n_sparse, n_query, heads_per_query, s_lenb,
                                                                  s_lenq, causal, n_splits, tl.program_id(0),
                                                                  tl.program_id(1), tl.program_id(2), SPARSE, MULTI,
                                                                  BLOCK_H, BLOCK_N)
    offs_p = tl.arange(0, BLOCK_P)[None, :]
    qp = tl.load(Qp + b * s_qpb + offs_h[:, None] * s_qph + offs_p, mask=mask_h[:, None] & (offs_p < P), other=0.0)
    unscale, prescale = _q_prescale(Qn, b, offs_h, mask_h, s_qnb, s_qnh, G)
    q0 = _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, prescale, 0)
    a0 = tl.zeros([BLOCK_H, 128], tl.float32)
    if G > 1:
        q1 = _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, prescale, 1)
        a1 = tl.zeros([BLOCK_H, 128], tl.float32)
    if G > 2:
        q2 = _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, prescale, 2)
        a2 = tl.zeros([BLOCK_H, 128], tl.float32)
    if G > 3:
        q3 = _q_group(Qn, b, offs_h, mask_h, s_qnb, s_qnh, prescale, 3)
        a3 = tl.zeros([BLOCK_H, 128], tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        page, off, valid = _tile_slots(Table, b, s_tb, offs_t, end, SPARSE, PS)
        rows = page * s_cp + off * s_cs
        srow = page * s_sp + off * s_ss
        k = tl.load(Kpe + (page * s_kp + off * s_ks)[:, None] + offs_p, mask=valid[:, None] & (offs_p < P), other=0.0)
        s = tl.zeros([BLOCK_H, BLOCK_N], tl.float32)
        s, s0 = _group_scores(s, Ckv, Scale, rows, srow, valid, q0, 0, DOT_PREC, DOT_UPCAST)
        if G > 1:
            s, s1 = _group_scores(s, Ckv, Scale, rows, srow, valid, q1, 1, DOT_PREC, DOT_UPCAST)
        if G > 2:
            s, s2 = _group_scores(s, Ckv, Scale, rows, srow, valid, q2, 2, DOT_PREC, DOT_UPCAST)
        if G > 3:
            s, s3 = _group_scores(s, Ckv, Scale, rows, srow, valid, q3, 3, DOT_PREC, DOT_UPCAST)
        s = s * unscale[:, None] + mma(qp, tl.trans(k), tl.zeros([BLOCK_H, BLOCK_N], tl.float32), DOT_PREC,
                                       DOT_UPCAST)
        s = tl.where(_tile_mask(valid, offs_t, limit, MULTI), s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of only masked slots stays NaN-free
        alpha = tl.exp2(m_i - m_use)
        p = tl.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
        a0 = _group_values(a0, Ckv, rows, valid, p, s0, alpha, 0, DOT_PREC, DOT_UPCAST)
        if G > 1:
            a1 = _group_values(a1, Ckv, rows, valid, p, s1, alpha, 1, DOT_PREC, DOT_UPCAST)
        if G > 2:
            a2 = _group_values(a2, Ckv, rows, valid, p, s2, alpha, 2, DOT_PREC, DOT_UPCAST)
        if G > 3:
            a3 = _group_values(a3, Ckv, rows, valid, p, s3, alpha, 3, DOT_PREC, DOT_UPCAST)
    inv, lse = _split_norm(m_i, l_i)
    o_row = split.to(tl.int64) * s_on + b * s_ob + offs_h[:, None] * s_oh
    _store_group(O, o_row, mask_h, a0, inv, 0)
    if G > 1:
        _store_group(O, o_row, mask_h, a1, inv, 1)
    if G > 2:
        _store_group(O, o_row, mask_h, a2, inv, 2)
    if G > 3:
        _store_group(O, o_row, mask_h, a3, inv, 3)
    tl.store(L + split * s_ln + b * s_lb + offs_h * s_lh, lse, mask=mask_h)
