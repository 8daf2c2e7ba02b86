"""The Triton stage-1 kernels of the split-KV decode (kernels/decode.py launches them): one program per
(request, block of BLOCK_H heads, KV split), the latent tile [BLOCK_N, R] loaded once and used by every head of
the block for both products (q.ckv^T and p.ckv). `_stage1_kernel` gathers tiles through pointers (any page size,
sparse index lists, several query tokens, an FP8 cache dequantized in registers); `_stage1_tma_kernel` loads whole
tiles as TMA boxes. Each split writes its normalised partial out and its natural-log lse (-inf when the split
holds no token)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._util import mma, pdl_enter
from .merge import arrive, merge_when_arrived, take_ticket


@triton.jit
def _split_range(n, split, n_splits, BLOCK_N: tl.constexpr):
    """[start, end) of this split's tokens: the split length is rounded to whole tiles, so only the last tile
    of a split is partial (start >= end when the split holds nothing)."""
    split_len = tl.cdiv(tl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(start + split_len, n)


@triton.jit
def _program_tokens(Lens, H, n_sparse, n_query, heads_per_query, s_lenb, s_lenq, causal, n_splits, b, hb, split,
                    SPARSE: tl.constexpr, MULTI: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """The (request b int64, its head rows offs_h [BLOCK_H], mask_h, split, limit, start, end) of program (b, head
    block hb, split): the tokens [start, end) of its split of the head block's range, and with MULTI each row's own
    causal limit [BLOCK_H] (`_stage1_kernel`'s docstring; without MULTI, limit is an unused placeholder)."""
    b = b.to(tl.int64)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < H
    limit = n_sparse
    if SPARSE:
        n = n_sparse
    elif MULTI:
        tok = offs_h // heads_per_query
        limit = tl.load(Lens + b * s_lenb + tok * s_lenq, mask=mask_h, other=0) + causal * (tok - n_query + 1)
        # limits grow with the query token, so the block's last row has the largest: the block's token range
        last = (tl.minimum(hb * BLOCK_H + BLOCK_H, H) - 1) // heads_per_query
        n = tl.maximum(tl.load(Lens + b * s_lenb + last * s_lenq) + causal * (last - n_query + 1), 0)
    else:
        n = tl.load(Lens + b)
    start, end = _split_range(n, split, n_splits, BLOCK_N)
    return b, offs_h, mask_h, split, limit, start, end


@triton.jit
def _tile_slots(Table, b, s_tb, offs_t, end, SPARSE: tl.constexpr, PS: tl.constexpr):
    """(page int64 [BLOCK_N], row in page [BLOCK_N], valid [BLOCK_N]) of tokens offs_t (< end): through the
    request's block table, or (SPARSE) its index list of physical slots (-1 entries invalid)."""
    valid = offs_t < end
    if SPARSE:
        slot = tl.load(Table + b * s_tb + offs_t, mask=valid, other=-1)  # Table holds the index list
        valid = valid & (slot >= 0)
        slot = tl.maximum(slot, 0)
        page = (slot // PS).to(tl.int64)
        off = slot % PS
    else:
        page = tl.load(Table + b * s_tb + offs_t // PS, mask=valid, other=0).to(tl.int64)
        off = offs_t % PS
    return page, off, valid


@triton.jit
def _tile_mask(valid, offs_t, limit, MULTI: tl.constexpr):
    """Which scores of a tile count: valid[None, :], and with MULTI each row's own limit ([BLOCK_H, BLOCK_N])."""
    if MULTI:
        return valid[None, :] & (offs_t[None, :] < limit[:, None])
    else:
        return valid[None, :]


@triton.jit
def _load_q(Qn, Qp, b, offs_h, mask_h, s_qnb, s_qnh, s_qpb, s_qph, R: tl.constexpr, P: tl.constexpr,
            RH: tl.constexpr, BLOCK_P: tl.constexpr):
    """q as the two latent halves and the rope part, [BLOCK_H, width] each."""
    offs_r = tl.arange(0, RH)[None, :]
    offs_p = tl.arange(0, BLOCK_P)[None, :]
    qn = Qn + b * s_qnb + offs_h[:, None] * s_qnh + offs_r
    qp = Qp + b * s_qpb + offs_h[:, None] * s_qph + offs_p
    mh = mask_h[:, None]
    return (tl.load(qn, mask=mh & (offs_r < R), other=0.0), tl.load(qn + RH, mask=mh & (offs_r + RH < R), other=0.0),
            tl.load(qp, mask=mh & (offs_p < P), other=0.0))


@triton.jit
def _load_tile(Ckv, Kpe, page, off, valid, s_cp, s_cs, s_kp, s_ks, R, P, RH: tl.constexpr, BLOCK_P: tl.constexpr):
    """One KV tile by pointers: token i at page[i] (int64 [BLOCK_N, 1], or one scalar page for the whole tile),
    row off[i] ([BLOCK_N, 1]) of it; returns latent halves c0 | c1 and rope k. Masked loads never touch invalid
    slots (unused cache slots may hold NaN)."""
    offs_r = tl.arange(0, RH)
    offs_p = tl.arange(0, BLOCK_P)
    rows = page * s_cp + off * s_cs
    c0 = tl.load(Ckv + rows + offs_r[None, :], mask=valid[:, None] & (offs_r[None, :] < R), other=0.0)
    c1 = tl.load(Ckv + rows + RH + offs_r[None, :], mask=valid[:, None] & (offs_r[None, :] + RH < R), other=0.0)
    k = tl.load(Kpe + page * s_kp + off * s_ks + offs_p[None, :], mask=valid[:, None] & (offs_p[None, :] < P),
                other=0.0)
    return c0, c1, k


@triton.jit
def _dequantize(c, Scale, srow, valid, col0: tl.constexpr, R: tl.constexpr, RH: tl.constexpr):
    """An FP8 latent tile half [BLOCK_N, RH] (columns col0 .. col0 + RH) -> float32 value * its group's scale
    (mla_compile/fp8.py: one float32 scale per 128 channels at Scale + srow + group). A half touches
    ceil(RH / 128) groups: one [BLOCK_N, 1] scale load each, selected per column (no per-element gather)."""
    cols = col0 + tl.arange(0, RH)[None, :]
    grp = cols // 128
    sc = tl.zeros(c.shape, tl.float32)
    for g in tl.static_range((RH + 127) // 128):
        gid = col0 // 128 + g
        s = tl.load(Scale + srow + gid, mask=valid[:, None] & (gid < R // 128), other=0.0)
        sc = tl.where(grp == gid, s, sc)
    return c.to(tl.float32) * sc


@triton.jit
def _tile_update(qn0, qn1, qp, c0, c1, k, mask, m_i, l_i, acc0, acc1, scale_log2, MASKED: tl.constexpr,
                 DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """One online-softmax step over a KV tile whose latent comes as two column halves c0 | c1:
    s = q.c^T [BLOCK_H, BLOCK_N] (base-2 units), acc [BLOCK_H, RH] per half. `mask` (MASKED): which scores count,
    broadcastable to [BLOCK_H, BLOCK_N] (valid[None, :] for one limit per tile, [BLOCK_H, BLOCK_N] for a causal
    limit per row)."""
    s = mma(qn0, tl.trans(c0), tl.zeros([qn0.shape[0], c0.shape[0]], tl.float32), DOT_PREC, DOT_UPCAST)
    s = mma(qn1, tl.trans(c1), s, DOT_PREC, DOT_UPCAST)
    s = mma(qp, tl.trans(k), s, DOT_PREC, DOT_UPCAST) * scale_log2
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of only masked slots stays NaN-free
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(c0.dtype)
    acc0 = mma(p, c0, acc0 * alpha[:, None], DOT_PREC, DOT_UPCAST)
    acc1 = mma(p, c1, acc1 * alpha[:, None], DOT_PREC, DOT_UPCAST)
    return m_new, l_i, acc0, acc1


@triton.jit
def _split_norm(m_i, l_i):
    """(1 / l, natural-log lse) of a split's running max m_i (base 2) and sum l_i: (1, -inf) where it saw no
    token, so its out is 0."""
    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    return inv, tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))


@triton.jit
def _store_split(O, L, split, b, offs_h, mask_h, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, R: tl.constexpr, m_i, l_i,
                 acc0, acc1, RH: tl.constexpr):
    """This split's normalised out and natural-log lse (-inf, out 0 when it saw no token)."""
    inv, lse = _split_norm(m_i, l_i)
    offs_r = tl.arange(0, RH)[None, :]
    o_ptr = O + split.to(tl.int64) * s_on + b * s_ob + offs_h[:, None] * s_oh + offs_r
    tl.store(o_ptr, acc0 * inv[:, None], mask=mask_h[:, None] & (offs_r < R))
    tl.store(o_ptr + RH, acc1 * inv[:, None], mask=mask_h[:, None] & (offs_r + RH < R))
    tl.store(L + split * s_ln + b * s_lb + offs_h * s_lh, lse, mask=mask_h)


@triton.jit
def _stage1_kernel(Qn, Qp, Ckv, Kpe, Table, Lens, O, L, Scale,
                   scale_log2, H, n_sparse,
                   s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss,
                   s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                   n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                   SPARSE: tl.constexpr, PS: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, RH: tl.constexpr, BLOCK_P: tl.constexpr,
                   DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, MULTI: tl.constexpr = False,
                   FP8: tl.constexpr = False, PDL: tl.constexpr = False):
    """Any page size, any R/P (masked to RH-wide halves), and sparse index lists: every tile by pointers.
    R and P are constexprs: with R == 2 * RH the width masks fold away, so tile loads vectorise (16 B) and
    pipeline as async copies (a runtime R leaves 2-byte loads); the page size is one too (token // PS and
    token % PS become shifts for powers of two).

    MULTI: n_query > 1 query tokens per request folded into the rows (H = n_query * heads_per_query rows, row
    j * heads_per_query + h is head h of query token j), so each KV tile is loaded once for every query token of
    the block. Row j sees tokens t < its own limit: Lens[b * s_lenb + j * s_lenq] + causal * (j - n_query + 1)
    (causal 1, s_lenq 0: the causal limits of one length per request; causal 0: a [B, n_query] table of limits,
    as DCP's per-rank counts; non-decreasing in j, like every causal limit). The block's token range runs to its
    largest limit, its last row's; each row masks the rest.

    FP8: Ckv holds float8_e4m3fn values with float32 scales at Scale (strides s_sp, s_ss per page / slot, one per
    128 channels: mla_compile/fp8.py); each tile is dequantized in registers (float32 value * scale, rounded once
    to q's dtype) before the MMAs, which run in q's dtype as for a bf16 cache."""
    pdl_enter(PDL)
    _stage1_program(Qn, Qp, Ckv, Kpe, Table, Lens, O, L, Scale, scale_log2, H, n_sparse, s_qnb, s_qnh, s_qpb, s_qph,
                    s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits, n_query,
                    heads_per_query, s_lenb, s_lenq, causal, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                    SPARSE, PS, R, P, BLOCK_H, BLOCK_N, RH, BLOCK_P, DOT_PREC, DOT_UPCAST, MULTI, FP8)


@triton.jit
def _stage1_merged_kernel(Qn, Qp, Ckv, Kpe, Table, Lens, O, L, Scale,
                          scale_log2, H, n_sparse,
                          s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss,
                          s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                          n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                          C, Out, Lse, s_outb, s_outh, s_lseb, s_lseh, B, n_merge,
                          SPARSE: tl.constexpr, PS: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, RH: tl.constexpr, BLOCK_P: tl.constexpr,
                          DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, MULTI: tl.constexpr,
                          FP8: tl.constexpr, MERGE_N: tl.constexpr, MERGE_R: tl.constexpr,
                          MERGE_ONE_PASS: tl.constexpr, PDL: tl.constexpr = False):
    """`_stage1_kernel` and the merge of its splits in one launch (kernels/merge.py, "a split launch that merges
    itself"): grid (B * ceil(H / BLOCK_H) * n_splits + n_merge,), the first tickets stage-1 programs (request fastest,
    as `_stage1_kernel`'s grid), the rest `merge_when_arrived`'s items; O / L the partials, Out / Lse the final
    out and lse, C the zeroed counters."""
    pdl_enter(PDL)
    n_hb = tl.cdiv(H, BLOCK_H)
    ticket, is_split = take_ticket(C, B * n_hb * n_splits)
    if is_split:
        b = ticket % B
        hb = (ticket // B) % n_hb
        _stage1_program(Qn, Qp, Ckv, Kpe, Table, Lens, O, L, Scale, scale_log2, H, n_sparse, s_qnb, s_qnh, s_qpb,
                        s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits,
                        n_query, heads_per_query, s_lenb, s_lenq, causal, b, hb, ticket // (B * n_hb), SPARSE, PS, R,
                        P, BLOCK_H, BLOCK_N, RH, BLOCK_P, DOT_PREC, DOT_UPCAST, MULTI, FP8)
        arrive(C, b * n_hb + hb)
    else:
        merge_when_arrived(C, ticket - B * n_hb * n_splits, n_merge, B, O, L, Out, Lse, n_splits, H, R,
                           s_on, s_ob, s_oh, s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb, s_lseh, BLOCK_H, MERGE_N,
                           MERGE_R, MERGE_ONE_PASS)


@triton.jit
def _stage1_program(Qn, Qp, Ckv, Kpe, Table, Lens, O, L, Scale, scale_log2, H, n_sparse,
                    s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss,
                    s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                    pid_b, pid_h, pid_split,
                    SPARSE: tl.constexpr, PS: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, RH: tl.constexpr, BLOCK_P: tl.constexpr,
                    DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, MULTI: tl.constexpr, FP8: tl.constexpr):
    """One `_stage1_kernel` program: request pid_b, head block pid_h, split pid_split."""
    b, offs_h, mask_h, split, limit, start, end = _program_tokens(Lens, H, n_sparse, n_query, heads_per_query, s_lenb,
                                                                  s_lenq, causal, n_splits, pid_b, pid_h, pid_split,
                                                                  SPARSE, MULTI, BLOCK_H, BLOCK_N)
    m_i, l_i, acc0, acc1 = _attend_range(Qn, Qp, Ckv, Kpe, Table, Scale, scale_log2, b, offs_h, mask_h, limit, start,
                                         end, s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss,
                                         SPARSE, PS, R, P, BLOCK_H, BLOCK_N, RH, BLOCK_P, DOT_PREC, DOT_UPCAST, MULTI,
                                         FP8)
    _store_split(O, L, split, b, offs_h, mask_h, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, R, m_i, l_i, acc0, acc1,
                 RH)


@triton.jit
def _attend_range(Qn, Qp, Ckv, Kpe, Table, Scale, scale_log2, b, offs_h, mask_h, limit, start, end,
                  s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_sp, s_ss,
                  SPARSE: tl.constexpr, PS: tl.constexpr, R: tl.constexpr, P: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_N: tl.constexpr, RH: tl.constexpr, BLOCK_P: tl.constexpr, DOT_PREC: tl.constexpr,
                  DOT_UPCAST: tl.constexpr, MULTI: tl.constexpr, FP8: tl.constexpr):
    """`_stage1_kernel`'s attention of its rows over tokens [start, end): (running max m (base 2), sum l, the two
    latent halves' accumulators), unnormalised (`_store_split` normalises)."""
    qn0, qn1, qp = _load_q(Qn, Qp, b, offs_h, mask_h, s_qnb, s_qnh, s_qpb, s_qph, R, P, RH, BLOCK_P)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, RH], tl.float32)
    acc1 = tl.zeros([BLOCK_H, RH], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        page, off, valid = _tile_slots(Table, b, s_tb, offs_t, end, SPARSE, PS)
        page, off = page[:, None], off[:, None]
        c0, c1, k = _load_tile(Ckv, Kpe, page, off, valid, s_cp, s_cs, s_kp, s_ks, R, P, RH, BLOCK_P)
        if FP8:
            srow = page * s_sp + off * s_ss
            c0 = _dequantize(c0, Scale, srow, valid, 0, R, RH).to(qn0.dtype)
            c1 = _dequantize(c1, Scale, srow, valid, RH, R, RH).to(qn0.dtype)
        mask = _tile_mask(valid, offs_t, limit, MULTI)
        m_i, l_i, acc0, acc1 = _tile_update(qn0, qn1, qp, c0, c1, k, mask, m_i, l_i, acc0, acc1, scale_log2,
                                            True, DOT_PREC, DOT_UPCAST)
    return m_i, l_i, acc0, acc1


@triton.jit
def _stage1_tma_kernel(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L,
                       scale_log2, H, PS,
                       s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb,
                       s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                       n_splits, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                       RH: tl.constexpr, P: tl.constexpr,
                       DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """Paged decode with whole tiles inside one page (PS % BLOCK_N == 0): each full tile is one TMA box
    per latent half (boxes are <= 256 wide) and one for the rope part; the partial last tile of a split
    uses masked loads, so slots past seq_len (which may hold NaN) are never read."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    mask_h = offs_h < H
    R = 2 * RH
    start, end = _split_range(tl.load(Lens + b), split, n_splits, BLOCK_N)
    full_end = tl.maximum(start, start + (end - start) // BLOCK_N * BLOCK_N)  # = start when end < start

    qn0, qn1, qp = _load_q(Qn, Qp, b, offs_h, mask_h, s_qnb, s_qnh, s_qpb, s_qph, R, P, RH, P)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, RH], tl.float32)
    acc1 = tl.zeros([BLOCK_H, RH], tl.float32)
    for t0 in range(start, full_end, BLOCK_N):
        page = tl.load(Table + b * s_tb + t0 // PS)
        row = page * PS + t0 % PS
        c0 = CkvDesc.load([row, 0])
        c1 = CkvDesc.load([row, RH])
        k = KpeDesc.load([row, 0])
        m_i, l_i, acc0, acc1 = _tile_update(qn0, qn1, qp, c0, c1, k, None, m_i, l_i, acc0, acc1, scale_log2,
                                            False, DOT_PREC, DOT_UPCAST)
    if full_end < end:
        offs_t = full_end + tl.arange(0, BLOCK_N)
        valid = offs_t < end
        page = tl.load(Table + b * s_tb + full_end // PS).to(tl.int64)  # the tile lies in one page
        c0, c1, k = _load_tile(Ckv, Kpe, page, (offs_t % PS)[:, None], valid, s_cp, s_cs, s_kp, s_ks, R, P, RH, P)
        m_i, l_i, acc0, acc1 = _tile_update(qn0, qn1, qp, c0, c1, k, valid[None, :], m_i, l_i, acc0, acc1,
                                            scale_log2, True, DOT_PREC, DOT_UPCAST)
    _store_split(O, L, split, b, offs_h, mask_h, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, R, m_i, l_i, acc0, acc1,
                 RH)
