"""Split-KV absorbed-MLA decode in Triton: `mla::decode` (paged) and `mla::sparse_decode` (index list).

Stage 1: one program per (request, block of BLOCK_H heads, KV split). The latent tile [BLOCK_N, R] is
loaded once and used by every head of the block for both products (q.ckv^T and p.ckv), which is what
makes MLA decode cheap: all heads share one KV head. Each split writes its normalised partial out and
its natural-log lse (-inf when the split holds no token).
Stage 2: the fused merge kernel of `merge.py` over the split axis (the same math as `mla::merge_states`).
With one split, stage 1 writes the final out/lse directly and stage 2 is skipped.

No host sync: the number of splits depends only on shapes (batch, heads, block-table capacity, SM count);
each program reads its request's length from device memory and computes its own token range, so a
captured CUDA graph stays valid when seq_lens change.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ._util import (block, box_width, caches_view_as_slots, cdiv, dot_mode, has_tma, mma, pdl_enter, pdl_launch,
                    query_limit_args, sm_count)
from ._launch import bind
from . import decode_seesaw as _seesaw
from . import decode_wgmma as _wgmma
from .merge import merge_into, merge_launch

_LOG2E = 1.4426950408889634


@triton.jit
def _split_range(n, split, n_splits, BLOCK_N: tl.constexpr):
    """[start, end) of this split's tokens: the split length is rounded to whole tiles, so only the last tile
    of a split is partial (start >= end when the split holds nothing)."""
    split_len = tl.cdiv(tl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    return start, tl.minimum(start + split_len, n)


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
def _store_split(O, L, split, b, offs_h, mask_h, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, R: tl.constexpr, m_i, l_i,
                 acc0, acc1, RH: tl.constexpr):
    """This split's normalised out and natural-log lse (-inf, out 0 when it saw no token)."""
    has = l_i > 0
    inv = 1.0 / tl.where(has, l_i, 1.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
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
    b = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    mask_h = offs_h < H
    if SPARSE:
        n = n_sparse
    elif MULTI:
        tok = offs_h // heads_per_query
        limit = tl.load(Lens + b * s_lenb + tok * s_lenq, mask=mask_h, other=0) + causal * (tok - n_query + 1)
        # limits grow with the query token, so the block's last row has the largest: the block's token range
        last = (tl.minimum(tl.program_id(1) * BLOCK_H + BLOCK_H, H) - 1) // heads_per_query
        n = tl.maximum(tl.load(Lens + b * s_lenb + last * s_lenq) + causal * (last - n_query + 1), 0)
    else:
        n = tl.load(Lens + b)
    start, end = _split_range(n, split, n_splits, BLOCK_N)
    qn0, qn1, qp = _load_q(Qn, Qp, b, offs_h, mask_h, s_qnb, s_qnh, s_qpb, s_qph, R, P, RH, BLOCK_P)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max, base-2 units
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc0 = tl.zeros([BLOCK_H, RH], tl.float32)
    acc1 = tl.zeros([BLOCK_H, RH], tl.float32)
    for t0 in range(start, end, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        valid = offs_t < end
        if SPARSE:
            slot = tl.load(Table + b * s_tb + offs_t, mask=valid, other=-1)  # Table holds the index list
            valid = valid & (slot >= 0)
            slot = tl.maximum(slot, 0)
            page = (slot // PS).to(tl.int64)[:, None]
            off = (slot % PS)[:, None]
        else:
            page = tl.load(Table + b * s_tb + offs_t // PS, mask=valid, other=0).to(tl.int64)[:, None]
            off = (offs_t % PS)[:, None]
        c0, c1, k = _load_tile(Ckv, Kpe, page, off, valid, s_cp, s_cs, s_kp, s_ks, R, P, RH, BLOCK_P)
        if FP8:
            srow = page * s_sp + off * s_ss
            c0 = _dequantize(c0, Scale, srow, valid, 0, R, RH).to(qn0.dtype)
            c1 = _dequantize(c1, Scale, srow, valid, RH, R, RH).to(qn0.dtype)
        if MULTI:
            mask = valid[None, :] & (offs_t[None, :] < limit[:, None])
        else:
            mask = valid[None, :]
        m_i, l_i, acc0, acc1 = _tile_update(qn0, qn1, qp, c0, c1, k, mask, m_i, l_i, acc0, acc1, scale_log2,
                                            True, DOT_PREC, DOT_UPCAST)
    _store_split(O, L, split, b, offs_h, mask_h, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, R, m_i, l_i, acc0, acc1,
                 RH)


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


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Stage-1 tiling and split policy. `ctas_per_sm` sets how many stage-1 programs the split count aims for."""

    block_h: int = 16
    block_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    ctas_per_sm: int = 2
    max_splits: int = 128
    min_split_tokens: int = 64
    tma: bool = False  # full tiles by TMA boxes where the layout allows (see tma_eligible)
    # the stage-1 kernel: "triton" (this file's, `tma` choosing its tiles), "wgmma" (decode_wgmma.py) or "seesaw"
    # (decode_seesaw.py), the Gluon many-head kernels. `dispatch.select_decode_kernel` chooses it for the call's
    # shapes, device and layout; it is not re-checked here
    kernel: str = "triton"


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def default_config(H: int, R: int, page_size: int, dtype: torch.dtype = torch.bfloat16) -> DecodeConfig:
    """From H200 sweeps (benchmarks/decode_sweep.py, round JSON at commit 20a0395; RESULTS.md): many heads
    take the TMA kernel where the layout allows it, few heads the pointer kernel at every page size. The pointer
    kernel gets one more stage when a tile spans pages (a page-1 token table, page 16): its addresses then come
    from a per-token table load that the next tile's copy waits on (page 1, H=16: 2 stages 20% slower than 3).

    fp32 operands (twice the bytes of the tuned half-precision tiles) take the pointer kernel at 32 rows x 16 tokens:
    the half-precision tiling needs 396-432 KB of shared memory in fp32 at 64 rows (the H200 has 227 KB; it failed
    there with OutOfResources) and spills at 16 rows; the fp32 tiling builds in 88-124 KB with no spill (sm_90a,
    tools/aot.py; tests/kernels/test_kernel_codegen.py guards it)."""
    if dtype == torch.float32:
        return multi_token_config(H, page_size, dtype)
    stages = 2 if page_size % 64 == 0 else 3  # both configs use 64-token tiles
    if H >= 64 and R <= 512:
        # many heads (compute-bound): a 64-row tile reaches Hopper's warpgroup MMA and reads each KV tile for
        # 64 heads at once; TMA h64n64w8s2 253-279 TFLOP/s vs 206-215 for the pointer kernel (3 stages there:
        # 2-5% ahead of 2)
        # On an H200 the Gluon kernels take these shapes where they can (dispatch.select_decode_kernel); this
        # config is the Triton fallback (another GPU, no Gluon) and the split policy they share
        return DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=stages, ctas_per_sm=1, tma=True)
    # few heads (bandwidth-bound): the pointer kernel (16-byte async copies, ~220 registers, no spills) with
    # 64-token tiles: 0.79-0.92 of copy bandwidth at kv >= 32K vs 0.71-0.83 for the TMA kernel, whose q operand
    # spills (rounds 7-9); 256 splits: batch 1 at 128K 54 us. Page 64: 2 stages 1.5-6% ahead of 3.
    return DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=stages, max_splits=256)


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def multi_token_config(rows: int, page_size: int, dtype: torch.dtype = torch.bfloat16) -> DecodeConfig:
    """S > 1 query tokens per request (rows = S * H): the pointer kernel with up to 64 rows per program, so a KV tile
    is loaded once for all S tokens of up to 64 rows (H 16: S <= 4 in one program). The Gluon / TMA many-head
    kernels take one query token per request only. Sized from the sm_90a builds (tools/aot.py, R 512 / P 64):
    rows past 16 double the accumulator and q, so 8 warps keep them in registers (32 rows: 194 registers, 112 KB
    shared); 64 rows with 64-token tiles need 216-221 KB of shared memory (at the H200's 227 KB limit) and spill,
    32-token tiles 144 KB and no spill. fp32 operands (twice the bytes) stay at 32 rows and 16-token tiles (124 KB)."""
    if dtype == torch.float32:
        block_h = min(32, block(rows))
        return DecodeConfig(block_h=block_h, block_n=16, num_warps=4 if block_h <= 16 else 8, num_stages=2,
                            max_splits=256)
    block_h = min(64, block(rows))
    stages = 2 if page_size % 64 == 0 else 3
    if block_h <= 16:
        return DecodeConfig(block_h=16, block_n=64, num_warps=4, num_stages=stages, max_splits=256)
    if block_h == 32:
        return DecodeConfig(block_h=32, block_n=64, num_warps=8, num_stages=stages, max_splits=256)
    return DecodeConfig(block_h=64, block_n=32, num_warps=8, num_stages=3, ctas_per_sm=1, max_splits=256)


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def fp8_config(rows: int, page_size: int, dtype: torch.dtype = torch.bfloat16, multi: bool = False) -> DecodeConfig:
    """An FP8 latent cache (the pointer kernel, tiles dequantized in registers; `multi`: S > 1 query tokens, rows =
    S * H). Sized from sm_90a builds (tools/aot.py, R 512 / P 64, bf16 q; tests/ops/test_fp8_cache.py guards them): the
    float32 dequantization of a tile doubles its registers, so the tiles are 32 tokens, not 64. 16 rows: 4 warps,
    214-229 registers, 105 KB shared, no spill (64-token tiles need 8 warps and 191 KB). More rows, one query
    token: 32 per program at 8 warps, 255 registers, 123 KB, no spill (64 rows spill 148-288 bytes at every tiling
    tried; with S > 1, 32 rows spill too, so those stay at 16). fp32 q (fp32 MMAs on the dequantized tile): 16 rows
    x 16 tokens, 4 warps, 255 registers, 115 KB, no spill (32 rows spill 548-1820 bytes). Not yet timed on a GPU."""
    if dtype == torch.float32:
        return DecodeConfig(block_h=16, block_n=16, num_warps=4, num_stages=2, max_splits=256)
    stages = 2 if page_size % 64 == 0 else 3
    if rows <= 16 or multi:
        return DecodeConfig(block_h=16, block_n=32, num_warps=4, num_stages=stages, max_splits=256)
    return DecodeConfig(block_h=32, block_n=32, num_warps=8, num_stages=stages, max_splits=256)


def num_splits(batch: int, heads: int, capacity: int, device: torch.device, cfg: DecodeConfig) -> int:
    """Splits from shapes only: as many as fit in one wave of `ctas_per_sm` programs per SM, never splits shorter
    than min_split_tokens. One wave, not more: H200 probe 2026-12-01 (benchmarks/RESULTS.md): H=16 B=32
    8 splits (256 programs) 88.9 / 310 us at 8K / 32K vs 98.5 / 318 for the ~2-wave 16; B=128 2 splits 316 vs
    4 323 at 8K; H=128 B=8 8 splits 269 / 1043 vs 16 279 / 1057 at 32K / 128K; B=8 H=16 keeps 33 (= 264 slots)."""
    programs = max(batch * cdiv(heads, cfg.block_h), 1)
    slots = cfg.ctas_per_sm * sm_count(device)
    cap = max(1, min(cdiv(max(capacity, 1), cfg.min_split_tokens), cfg.max_splits))
    return max(1, min(slots // programs, cap))


def tma_eligible(ckv_cache, kpe_cache, sparse: bool, cfg: DecodeConfig) -> bool:
    """The TMA kernel needs an sm_90+ GPU (or the interpreter), whole tiles inside a page, the latent in two
    power-of-two halves <= 256 wide (a TMA box side is at most 256), a power-of-two rope width, and caches
    that view as [slots, width]."""
    if sparse or not has_tma(ckv_cache.device):
        return False
    NP, PS, R = ckv_cache.shape
    P = kpe_cache.shape[2]
    return tma_tiles_fit(cfg, PS, R, P) and caches_view_as_slots(ckv_cache, kpe_cache)


def tma_tiles_fit(cfg: DecodeConfig, page_size: int, R: int, P: int) -> bool:
    """The shape half of `tma_eligible`: TMA asked for, whole tiles inside a page, boxes of powers of two <= 256."""
    return cfg.tma and page_size % cfg.block_n == 0 and R % 2 == 0 and box_width(R // 2) and box_width(P)


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def tma_constexprs(cfg: DecodeConfig, R: int, P: int, dtype: torch.dtype) -> dict:
    """The compile-time arguments of `_stage1_tma_kernel` (shared with tests/kernels/test_kernel_codegen.py)."""
    return dict(BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, RH=R // 2, P=P, **dot_mode(dtype))


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def pointer_constexprs(cfg: DecodeConfig, R: int, P: int, page_size: int, sparse: bool, dtype: torch.dtype,
                       multi: bool = False, fp8: bool = False) -> dict:
    """The compile-time arguments of `_stage1_kernel` (shared with tests/kernels/test_kernel_codegen.py); `multi`: several
    query tokens per request, each row with its own causal limit; `fp8`: an FP8 latent cache (q in `dtype`)."""
    return dict(SPARSE=sparse, PS=page_size, R=R, P=P, BLOCK_H=cfg.block_h,
                BLOCK_N=cfg.block_n, RH=max(16, block(R) // 2), BLOCK_P=block(P), MULTI=multi, FP8=fp8,
                **dot_mode(dtype))


def _tma_stage1(q_nope, q_pe, ckv_cache, kpe_cache, block_table, sm_scale, o, l, s_on, s_ln, ns, cfg: DecodeConfig):
    """(`_stage1_tma_kernel` bound to its grid and compile-time arguments, its descriptor templates, the numbers
    after its ten tensor arguments): what a call's signature fixes. Launch: `bound(q_nope, q_pe, *descriptors(...),
    ckv_cache, kpe_cache, block_table, seq_lens, o, l, *numbers)`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, H, R = q_nope.shape
    NP, PS, _ = ckv_cache.shape
    P = kpe_cache.shape[2]
    templates = (TensorDescriptor(ckv_cache, [NP * PS, R], [ckv_cache.stride(1), 1], [cfg.block_n, R // 2]),
                 TensorDescriptor(kpe_cache, [NP * PS, P], [kpe_cache.stride(1), 1], [cfg.block_n, P]))
    for t in templates:
        t.base = None  # validated; a plan keeps no tensor alive (each call's descriptors get their own bases)
    bound = bind(_stage1_tma_kernel, (B, cdiv(H, cfg.block_h), ns), n_splits=ns,
                 **tma_constexprs(cfg, R, P, q_nope.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                 **pdl_launch(q_nope.device))
    numbers = (sm_scale * _LOG2E, H, PS,
               q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
               ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1),
               block_table.stride(0), s_on, o.stride(-3), o.stride(-2), s_ln, l.stride(-2), l.stride(-1))
    return bound, templates, numbers


def _descriptors(templates, ckv_cache, kpe_cache):
    """The TMA descriptors of this call's caches: copies of the plan's templates with the new bases (shape,
    strides, box and alignment fixed by the signature; a fresh TensorDescriptor re-validates all of it in Python,
    ~5 us each). The caches view as [slots, width]: the base is the cache itself, only its pointer is read."""
    out = []
    for template, base in zip(templates, (ckv_cache, kpe_cache)):
        d = object.__new__(type(template))
        d.__dict__.update(template.__dict__)
        d.base = base
        out.append(d)
    return out


def _pointer_stage1(q_nope, q_pe, ckv_cache, kpe_cache, table, sparse: bool, seq_lens, sm_scale, o, l, s_on, s_ln,
                    ns, cfg: DecodeConfig, n_query: int = 1, ckv_scale=None):
    """(`_stage1_kernel` bound to its grid and compile-time arguments, the numbers after its nine tensor
    arguments). Launch: `bound(q_nope, q_pe, ckv_cache, kpe_cache, table, table if sparse else seq_lens, o, l,
    ckv_scale if FP8 else o, *numbers)` (o: an unread placeholder pointer without FP8)."""
    B, H, R = q_nope.shape
    P = q_pe.shape[2]
    fp8 = ckv_scale is not None
    s_sp, s_ss = (ckv_scale.stride(0), ckv_scale.stride(1)) if fp8 else (0, 0)
    sqn, sqp, sc, sk, so, sl = (t.stride() for t in (q_nope, q_pe, ckv_cache, kpe_cache, o, l))
    bound = bind(_stage1_kernel, (B, cdiv(H, cfg.block_h), ns),
                 **pointer_constexprs(cfg, R, P, ckv_cache.shape[1], sparse, q_nope.dtype, n_query > 1, fp8),
                 num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl_launch(q_nope.device))
    numbers = (sm_scale * _LOG2E, H, table.shape[1] if sparse else 0,
               sqn[0], sqn[1], sqp[0], sqp[1], sc[0], sc[1], sk[0], sk[1],
               table.stride(0), s_sp, s_ss,
               s_on, so[-3], so[-2], s_ln, sl[-2], sl[-1],
               ns, *query_limit_args(seq_lens, n_query, H))
    return bound, numbers


def _launch_tma(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns,
                cfg: DecodeConfig):
    """One launch of the Triton TMA stage-1 kernel (benchmarks time it alone); returns the compiled kernel."""
    bound, templates, numbers = _tma_stage1(q_nope, q_pe, ckv_cache, kpe_cache, block_table, sm_scale, o, l, s_on,
                                            s_ln, ns, cfg)
    return bound(q_nope, q_pe, *_descriptors(templates, ckv_cache, kpe_cache), ckv_cache, kpe_cache, block_table,
                 seq_lens, o, l, *numbers)


def _launch_pointer(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, indices, sm_scale, o, l, s_on,
                    s_ln, ns, cfg: DecodeConfig, n_query: int = 1, ckv_scale=None):
    """One launch of the Triton pointer stage-1 kernel (benchmarks time it alone); returns the compiled kernel."""
    sparse = indices is not None
    table = indices if sparse else block_table
    bound, numbers = _pointer_stage1(q_nope, q_pe, ckv_cache, kpe_cache, table, sparse, seq_lens, sm_scale, o, l,
                                     s_on, s_ln, ns, cfg, n_query, ckv_scale)
    return bound(q_nope, q_pe, ckv_cache, kpe_cache, table, table if sparse else seq_lens, o, l,
                 ckv_scale if ckv_scale is not None else o, *numbers)


def _unit_inner_stride(t):
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def _contiguous_strides(shape) -> tuple:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class AttendPlan:
    """One decode call's work with everything its signature fixes decided once: the kernel, tiling and splits, the
    output and partial shapes, the launches bound to their grids and compile-time arguments and the numbers they
    take. Calling it runs the kernels on that call's tensors: the allocations, the stream and the launches only.

    The signature: the shapes, strides, dtypes and device of every tensor argument, whether each is 16-byte aligned
    (Triton specializes on it), the scalars, and the config asked for (the op's impl keys its plans on it,
    ops/attention.py; any other caller builds a plan per call, which costs what the unplanned path did)."""

    def __init__(self, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, indices, sm_scale, capacity,
                 cfg: DecodeConfig | None, splits: int | None, n_query: int = 1, ckv_scale=None):
        B, H, R = q_nope.shape  # H: rows per request (n_query * heads)
        self.device, self.dtype, self.out_shape, self.lse_shape = q_nope.device, q_nope.dtype, q_nope.shape, (B, H)
        self.sparse, self.n_query, self.ckv_scale_given = indices is not None, n_query, ckv_scale is not None
        self.empty = B * H == 0
        if self.empty:
            return
        # q is read with any batch/head strides; the ops are flexible_layout, so Inductor may also hand over strided
        # lengths / tables. The kernels need unit inner strides only: copy just what lacks them
        self.copies = tuple(t is not None and t.stride(-1) != 1 for t in (q_nope, q_pe, seq_lens, block_table,
                                                                           indices))
        q_nope, q_pe, seq_lens, block_table, indices = map(_unit_inner_stride, (q_nope, q_pe, seq_lens, block_table,
                                                                                 indices))
        for t, name in ((ckv_cache, "ckv_cache"), (kpe_cache, "kpe_cache"), (ckv_scale, "ckv_scale")):
            if t is not None and t.stride(-1) != 1:
                raise ValueError(f"{name}: last dim must be contiguous for the Triton kernel, strides {t.stride()}")
        # an index list (sparse_decode) gathers every token through a table load, as a page-1 token table does
        page_size = 1 if self.sparse else ckv_cache.shape[1]
        multi = n_query > 1
        fp8 = ckv_scale is not None
        cfg = cfg or (fp8_config(H, page_size, q_nope.dtype, multi) if fp8 else
                      multi_token_config(H, page_size, q_nope.dtype) if multi else
                      default_config(H, R, page_size, q_nope.dtype))
        self.cfg = cfg
        self.ns = ns = splits or num_splits(B, H, capacity, q_nope.device, cfg)
        self.partial_shapes = ((ns, B, H, R), (ns, B, H))
        # strides of what the kernels write: the final out / lse with one split, else the partials
        meta = torch.device("meta")
        o, l = ((torch.empty(self.out_shape, device=meta), torch.empty(self.lse_shape, device=meta)) if ns == 1 else
                (torch.empty(self.partial_shapes[0], device=meta), torch.empty(self.partial_shapes[1], device=meta)))
        s_on, s_ln = (0, 0) if ns == 1 else (o.stride(0), l.stride(0))
        # several query tokens: the pointer kernel or a Gluon one (their rows carry per-token limits; the Triton TMA
        # kernel takes one limit per request)
        if fp8:  # the pointer kernel dequantizes its tiles; the TMA and Gluon kernels read fp16/bf16 caches only
            self.kind = "pointer"
        elif cfg.kernel in ("seesaw", "wgmma"):
            self.kind = cfg.kernel
        elif not multi and tma_eligible(ckv_cache, kpe_cache, self.sparse, cfg):
            self.kind = "tma"
        else:
            self.kind = "pointer"
        if self.kind == "tma":
            self.stage1, self.templates, self.numbers = _tma_stage1(
                q_nope, q_pe, ckv_cache, kpe_cache, block_table, sm_scale, o, l, s_on, s_ln, ns, cfg)
        elif self.kind == "pointer":
            table = indices if self.sparse else block_table
            self.stage1, self.numbers = _pointer_stage1(q_nope, q_pe, ckv_cache, kpe_cache, table, self.sparse,
                                                        seq_lens, sm_scale, o, l, s_on, s_ln, ns, cfg, n_query,
                                                        ckv_scale)
        else:
            self.sm_scale, self.s_on, self.s_ln = sm_scale, s_on, s_ln
        if ns > 1:
            out = torch.empty(self.out_shape, device=meta)
            self.merge = merge_launch(o, l, out, torch.empty(self.lse_shape, device=meta))

    def __call__(self, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, indices=None, ckv_scale=None):
        device = self.device
        out = torch.empty(self.out_shape, dtype=self.dtype, device=device)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=device)
        if self.empty:
            return out, lse
        if any(self.copies):
            q_nope, q_pe, seq_lens, block_table, indices = map(_unit_inner_stride, (q_nope, q_pe, seq_lens,
                                                                                     block_table, indices))
        ns = self.ns
        if ns == 1:
            o, l = out, lse
        else:
            o = torch.empty(self.partial_shapes[0], dtype=torch.float32, device=device)
            l = torch.empty(self.partial_shapes[1], dtype=torch.float32, device=device)
        kind = self.kind
        if kind == "pointer":
            table = indices if self.sparse else block_table
            self.stage1(q_nope, q_pe, ckv_cache, kpe_cache, table, table if self.sparse else seq_lens, o, l,
                        ckv_scale if ckv_scale is not None else o, *self.numbers)
        elif kind == "tma":
            self.stage1(q_nope, q_pe, *_descriptors(self.templates, ckv_cache, kpe_cache), ckv_cache, kpe_cache,
                        block_table, seq_lens, o, l, *self.numbers)
        elif kind == "seesaw":
            _seesaw.launch(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, self.sm_scale, o, l,
                           self.s_on, self.s_ln, ns, n_query=self.n_query)
        else:
            _wgmma.launch(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, self.sm_scale, o, l, self.s_on,
                          self.s_ln, ns, indices=indices, n_query=self.n_query)
        if ns > 1:
            self.merge(o, l, out, lse)
        return out, lse


def decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, *, cfg=None, splits=None,
                n_query: int = 1, ckv_scale=None) -> AttendPlan:
    """`decode`'s plan for these tensors' signature: `plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table,
    seq_lens, None, ckv_scale)` runs it on any tensors of that signature."""
    capacity = block_table.shape[1] * ckv_cache.shape[1]  # the longest a request can be: shape-only
    return AttendPlan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, None, sm_scale, capacity, cfg, splits,
                      n_query, ckv_scale)


def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, *, cfg=None, splits=None,
           n_query: int = 1, ckv_scale=None):
    """`mla::decode` on the GPU (or under TRITON_INTERPRET=1): (out [B, H, R] q dtype, lse float32 [B, H]).

    n_query = S > 1: S query tokens per request folded into the rows, q [B, S * H, R] with row j * H + h = head h
    of query token j (what q [B, S, H, R].reshape(B, S * H, R) gives), out / lse likewise. seq_lens int32 [B]
    counts the S new tokens (token j sees t < seq_lens[b] - S + 1 + j), or int32 [B, S] gives each query token's
    limit itself (DCP's per-rank counts). The pointer kernel, each KV tile loaded once for all S tokens.
    ckv_scale: an FP8 ckv_cache's scales (mla_compile/fp8.py): the pointer kernel, tiles dequantized in registers."""
    return decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, cfg=cfg, splits=splits,
                       n_query=n_query, ckv_scale=ckv_scale)(q_nope, q_pe, ckv_cache, kpe_cache, block_table,
                                                             seq_lens, None, ckv_scale)


def sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, *, cfg=None, splits=None,
                       ckv_scale=None) -> AttendPlan:
    """`sparse_decode`'s plan: `plan(q_nope, q_pe, ckv_cache, kpe_cache, None, None, indices, ckv_scale)`."""
    return AttendPlan(q_nope, q_pe, ckv_cache, kpe_cache, None, None, indices, sm_scale, indices.shape[1], cfg, splits,
                      ckv_scale=ckv_scale)


def sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, *, cfg=None, splits=None, ckv_scale=None):
    """`mla::sparse_decode`: attention over the physical slots in indices [B, K] (-1 ignored)."""
    return sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, cfg=cfg, splits=splits,
                              ckv_scale=ckv_scale)(q_nope, q_pe, ckv_cache, kpe_cache, None, None, indices, ckv_scale)


def flops(batch: int, heads: int, kv_len: int, R: int, P: int) -> float:
    """Matrix FLOPs of one decode: q.[ckv|kpe]^T and p.ckv per head and token."""
    return 2.0 * batch * heads * kv_len * (R + P + R)


def kv_bytes(batch: int, kv_len: int, R: int, P: int, itemsize: int) -> float:
    return float(batch) * kv_len * (R + P) * itemsize

