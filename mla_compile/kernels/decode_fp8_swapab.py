"""FP8 latent cache decode, stage 1, in Gluon for few heads: the warpgroup MMA's operands swapped so that its M (64)
is tokens, not heads (the format: mla_compile/fp8.py).

Why: a Hopper warpgroup MMA has M = 64; with 16 heads a heads-by-tokens MMA pads the heads to 64 (4x the work), and
the Triton FP8 kernel (kernels/decode_fp8.py, mma.sync) read the cache at ~0.25 of copy bandwidth (H200: H 16 B 8
32K 171 us against 89.6 for our bf16 cache). Both products are computed transposed, tokens x heads:

    S^T [64 tokens, N]  = sum_g diag(scale_g) K8_g [64, 128] . q_g^T [128, N]  +  Krope [64, 64] . q_rope^T [64, N]
    O_g^T [128, N]     += K8_g^T [128, 64 tokens] . (diag(scale_g) P^T) [64 tokens, N]      (g: 4 scale groups)

Exact, as kernels/decode_fp8.py (the scales folded into the products, no value x scale ever rounded): the tile holds
the e4m3 values themselves in fp16 (exact; one cvt.rn.f16x2.e4m3x2 per two); q's latent part goes to fp16 times a
power of two that puts the head block's largest |value| in [2^13, 2^14) (exact for bf16 values within fp16's range),
the scores times its inverse; each group's score MMA has its own fp32 accumulator, combined with the scale per ROW
(token) of S^T; each group's P.V takes its own P^T tile, P^T x scale_g / top_g in fp16 (top_g the tile's largest
scale_g: in [0, 1], no underflow of small scales; 11 mantissa bits where bf16 has 8), its accumulator kept in units
of top_g (the factor previous top / this top joins the softmax's rescale; times the last top at the end). The rope
part stays bf16 (its own MMA, first in the chain). lse within ~2e-6 of float64 over the dequantized values in a CPU
emulation (benchmarks/lab/fp8_swapab.py --emulate), where rounding value x scale to bf16 (EXACT=False, kept for
comparison) is ~1e-2 off.

A (the big operand) is the tile in shared memory: K-major for the scores, the same tile seen transposed (MN-major,
16-bit) for P.V; B is q ([N, 576], K-major, loaded once) and P^T ([64, N]). The online softmax runs per head = per
COLUMN of S^T (base 2); O^T is four [128, N] fp32 accumulators, one per scale group. N is 16, 32 or 64 (BLOCK_HS):
at N = 64 over two warpgroups O^T alone is 128 registers a thread, and with the exact scores it spills (255
registers, 24-44 bytes, even folding each group's scores in before the next issues: `_tile` FOLD), yet it reads the
cache once for 64 heads where blocks of 32 read it twice: 151.5 against 224.1 us at H 64 B 8 32K (H200, RESULTS.md
2026-12-05). More heads take blocks of 64.

One program per (request, block of N heads, KV split), grid (B * ceil(H / N), n_splits). Per 64-token tile: TMA
copies into one of STAGES staging slots on one mbarrier (the e4m3 bytes as [64, 256] boxes, the [64, 4] float32
scales, the [64, 64] rope); each scale group converted in registers and stored into an NVMMA-swizzled 16-bit tile,
fenced, its score MMA issued while the next group converts; the softmax; the four P^T into shared memory; the slot
refilled; the four P.V MMAs left in flight into the next tile. A split's partial last tile is a second instance of
the tile step (MASKED): rows past the end are zeroed before any MMA reads them (unused slots may hold NaN bytes) and
score -inf. Each split writes the normalised partial out and natural-log lse (-inf for a split without tokens):
the contract of every stage-1 kernel here, so kernels/merge.py combines the splits.

GATHER form (pages that are no whole tiles: the page-size-1 token table the HF pass hands over, page 16): the same
kernel with each tile's rows fetched by 16-byte cp.async copies through the table (slot = table[b, t // PS] * PS +
t % PS; a 656-byte token is 41 chunks: 32 e4m3, 1 of scales, 8 rope) into the same staging slots, each thread's
copies then arriving on the slot's mbarrier (cp.async.mbarrier.arrive.noinc, the barrier counting every thread), so
everything after the copies is shared; rows past the end are zero-filled, their table entries never read. A tile's
table entries are loaded at the top of the tile before the one whose fill copies them (`_gather_pages`), so the
copies never wait for the table: 1.20x the TMA form's time at H 16 B 8 32K (H100: 102.7 vs 85.3 us; 1.93x with
the loads beside the copies).

TOKENS form (a page-size-1 token table whose views are TMA rows too, `token_rows`: what the HF pass hands over; the
bf16 kernel's TOKENS form, decode_swapab.py, for this format): GATHER's kernel with the TMA form's descriptors beside
its pointers. Each tile's 64 entries are loaded a tile ahead in a layout of their own, every warp holding all of
them, and two in-warp reductions (`_gluon.run_start`) tell whether they are consecutive rows r0, r0 + 1, ... (tokens
past the end aside: a request's tokens in a static cache, at any offset); such a tile is the TMA form's boxes at row
r0 of the slot views, one thread arriving for the rest of the barrier's count (it counts every thread, for the row
copies); any other tile keeps GATHER's row copies, their entries loaded when it issues them (not a tile ahead: that
held registers and three loads a tile for the rare tile that is no run). A split's partial last tile has its rope
rows past the end zeroed, as the TMA form's (a run's boxes read whatever follows it). Taken by default for blocks
of 16 heads (`TOKENS_IN_AUTO`, `TOKENS_MAX_N`: measured below), or where MLA_COMPILE_SWAPAB_TOKENS=1
(mla_compile/tuning.swapab_tokens) or `stage1_plan(tokens=True)` asks.

Takes: sm_90, Gluon, bf16 q, R 512 / P 64, one query token (`fits`), pages of whole 64-token tiles whose three views
(fp8.views) are TMA boxes (`eligible`) or, GATHER, views of 16-byte aligned rows at any page size
(`gather_eligible`; TOKENS: `token_rows`); `dispatch.decode_kernel` decides the kernel, `stage1_plan` the form.
Found building it (sm_90a, Triton 3.6, tools/aot.py): waiting for one P.V at a time made ptxas serialise every wgmma
(C7514), so one wait retires a tile's; LLVM hoisted ~100 loop-invariant wgmma descriptors out of the loop (255 registers
and spills at N = 16): an opaque zero in the group indices keeps them in the loop (187 registers; exact scores: 187 at
N = 16, 177 at N = 32 over two warpgroups; GATHER, page 1: 242 and 206 with its table entries loaded early, page 16: 255
and 218, no spills; TOKENS: 215 and 192 with only the run check's entries loaded a tile ahead (244 and 201 with all
four), no spills; at N = 64 every form spills a little: TMA 44 bytes, GATHER 24, TOKENS 16). Measured (the
bf16-rounding version): benchmarks/RESULTS.md ("FP8 decode, the swap-AB Gluon kernel").
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch

from .. import fp8
from .. import tuning as _tuning
from . import _gluon as G
from ._launch import bind, templated_at, without_bases
from ._util import cdiv, slot_stride, tma_rows

if G.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from ._fp8_swapab_tile import _fill_slot, _store_group, _tile

# Whether dispatch sends FP8 calls here (`dispatch.decode_kernel`: the `fp8_rows` fact). On by default: on the H200
# it matches float64 (benchmarks/lab/fp8_swapab.py's checks, tests/gpu/test_fp8_cuda.py) and takes about half the time
# of the Triton FP8 kernel (RESULTS.md, 2026-12-05). MLA_COMPILE_FP8_SWAPAB=0 (read at import) sends FP8 calls to the
# Triton kernel instead; tests/gpu/test_fp8_cuda.py runs both.
ENABLED = os.environ.get("MLA_COMPILE_FP8_SWAPAB", "1") != "0"
R, P = 512, 64  # latent and rope widths the format and this kernel take
GW = fp8.GROUP  # channels per scale group (128)
GROUPS = R // GW  # 4
W_TOKEN = fp8.token_bytes(R, P)  # 656 bytes a token
BLOCK_T = 64  # tokens per tile: the MMA's M
E_BOX = 256  # e4m3 columns per TMA box: two scale groups (a box side is at most 256 elements)
BLOCK_HS = (16, 32, 64)  # heads per program (the MMA's N): more heads, blocks of 64 (a few spilled bytes, see above)
# The TOKENS form over token tables (the HF pass's caches) by default, for blocks of at most TOKENS_MAX_N heads
# (MLA_COMPILE_SWAPAB_TOKENS = 1 / 0 overrides both: tuning.swapab_tokens). H100 2026-12-06 (benchmarks/RESULTS.md, the
# FP8 TOKENS form), B 8 32K, us against GATHER's, with the row copies' entries loaded only for tiles that are no run:
# N 16 94.1 vs 101.0 on a static cache's runs (tiles of consecutive rows: also pages of >= 64 tokens), 97.1 vs
# 101.3 with holes, 108.5 vs 101.7 on shuffled rows (pages under 64 tokens), B 1 19.5 vs 21.8; the HF step (H 16
# B 8 32K, hf_profile --ab 3) 795.5 vs 826.4 us. N 32: 124.9 vs 122.7 on runs (two warpgroups spread GATHER's
# copies), so blocks of 32 and 64 keep GATHER
TOKENS_IN_AUTO = True
TOKENS_MAX_N = 16


if G.gluon is not None:
    _GW = gl.constexpr(GW)
    _GROUPS, _BLOCK_T, _E_BOX, _P = gl.constexpr(GROUPS), gl.constexpr(BLOCK_T), gl.constexpr(E_BOX), gl.constexpr(P)

    @gluon.jit
    def _fp8_swapab_kernel(Qn, Qp, EDesc, SDesc, RDesc, Table, Lens, O, L,
                           scale_log2, H,
                           s_qnb, s_qnh, s_qpb, s_qph, s_tb,
                           s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits, s_ep, s_et, s_sp, s_st, s_rp, s_rt,
                           EPtr, SPtr, RPtr,
                           PS: gl.constexpr, N: gl.constexpr, WG: gl.constexpr, STAGES: gl.constexpr, PRE: gl.constexpr,
                           SLAB: gl.constexpr, P_ROPE: gl.constexpr, EXACT: gl.constexpr = True,
                           GATHER: gl.constexpr = False, TOKENS: gl.constexpr = False, PDL: gl.constexpr = False):
        """Stage 1 over an FP8 token buffer (module docstring). Qn [B, H, 512] / Qp [B, H, 64] bf16; EDesc / SDesc /
        RDesc: TMA descriptors over the buffer's slots [NP * PS, 656] seen as e4m3 ([64, 256] boxes), float32
        ([64, 4]) and bf16 ([64, 64]); Table int32 [B, max_pages]; Lens int32 [B]; O fp32 [n_splits, B, H, 512]
        and L fp32 [n_splits, B, H] (normalised partial out, natural-log lse). N heads per program, 4 * WG warps,
        STAGES staging slots; PRE, SLAB, P_ROPE: `Tiling` / `_tile`. EXACT (the default; the module docstring): the
        scores and P.V over the stored values exactly (e4m3 in fp16, the scales on fp32 products); False: the
        comparison variant that rounds value x scale to a bf16 tile (lse ~1e-2 off, benchmarks/lab/fp8_swapab.py).
        GATHER: EDesc / SDesc / RDesc are instead pointers to the three views (16-byte aligned), s_ep .. s_rt their
        page and token strides in 16-byte units (a size-1 dimension's: 0), any page size PS; each tile's rows come by
        16-byte cp.async copies through the table into the same staging slots (`_fp8_swapab_tile._gather_tile`).
        The TMA form ignores s_ep .. s_rt. TOKENS (with GATHER, PS 1: a token table): EDesc / SDesc / RDesc are the
        TMA form's descriptors, EPtr / SPtr / RPtr GATHER's pointers (None in the other forms: constexprs, so their
        builds are unchanged), and each tile takes the boxes or the row copies as its entries say (`_fill_slot`).
        PDL: launched with programmatic dependent launch (`_gluon.pdl_launch`)."""
        G.pdl_enter(PDL)
        gl.static_assert(gl.num_warps() == 4 * WG, "WG warpgroups")
        GW: gl.constexpr = _GW  # channels per scale group (128)
        SC_COL: gl.constexpr = 0  # the scales' and the rope's descriptors are over their own views (column 0)
        RP_COL: gl.constexpr = 0
        if GATHER and not TOKENS:
            BT: gl.constexpr = _BLOCK_T  # tokens per tile (64)
            GROUPS: gl.constexpr = _GROUPS  # scale groups (4)
            EB: gl.constexpr = _E_BOX  # e4m3 columns per staging box
            P: gl.constexpr = _P
            e_dt: gl.constexpr = EDesc.dtype.element_ty
            s_dt: gl.constexpr = SDesc.dtype.element_ty
            r_dt: gl.constexpr = RDesc.dtype.element_ty
            # the layouts the TMA form's descriptors carry (`_layouts`)
            e_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, EB], e_dt)
            s_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, GROUPS], s_dt)
            r_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, P], r_dt)
            src = (EDesc, SDesc, RDesc, s_ep, s_et, s_sp, s_st, s_rp, s_rt)
        else:
            BT: gl.constexpr = EDesc.block_type.shape[0]  # tokens per tile (64)
            GROUPS: gl.constexpr = SDesc.block_type.shape[1]  # scale groups (4)
            EB: gl.constexpr = EDesc.block_type.shape[1]
            P: gl.constexpr = RDesc.block_type.shape[1]
            e_dt: gl.constexpr = EDesc.dtype
            s_dt: gl.constexpr = SDesc.dtype
            r_dt: gl.constexpr = RDesc.dtype
            e_l: gl.constexpr = EDesc.layout
            s_l: gl.constexpr = SDesc.layout
            r_l: gl.constexpr = RDesc.layout
            if TOKENS:  # GATHER's pointers and strides, then the boxes' descriptors (`_fill_slot`)
                gl.static_assert(GATHER and PS == 1, "TOKENS: GATHER's machinery over a token table")
                src = (EPtr, SPtr, RPtr, s_ep, s_et, s_sp, s_st, s_rp, s_rt, EDesc, SDesc, RDesc)
            else:
                gl.static_assert(PS % BT == 0, "a tile lies inside one page")
                src = (EDesc, SDesc, RDesc)
        NB: gl.constexpr = GROUPS * GW // EB  # e4m3 boxes a tile
        # scores [64 tokens, N]: one warpgroup's m64 over the tokens; with two warpgroups each takes half the heads
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, N // WG, 16])
        # O^T group [128 channels, N]: warpgroups along the channels (m64 blocks), each with every head
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG, 1],
                                                      instr_shape=[16, N, 16])
        # dequantization: 8 e4m3 bytes a thread, 16 lanes along a 128-byte row (a half warp reads one whole row:
        # 8-byte loads conflict-free whatever the swizzle), each thread's 8 bf16 = one 16-byte chunk of the NVMMA
        # tile (8 lanes store one 128-byte swizzle row: conflict-free)
        CVT: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4 * WG, 1], [1, 0])
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4 * WG, 1], [1, 0])  # q: 16-byte global loads
        dt: gl.constexpr = Qn.dtype.element_ty

        b, hb, split, start, end, n_full, n_tiles = G.swapab_program(Lens, H, n_splits, gl.program_id(0),
                                                                            gl.program_id(1), N, BT)

        # q of this head block, once, as the B operands: [N, 128] per scale group and [N, 64] rope (heads >= H: 0)
        offs_h = hb * N + gl.arange(0, N, layout=gl.SliceLayout(1, LD))
        mask_h = offs_h < H
        qn_rows = b * s_qnb + offs_h * s_qnh
        offs_c = gl.arange(0, GW, layout=gl.SliceLayout(0, LD))
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(0, LD))
        if EXACT:
            # fp16, times the power of two 2^-e that puts the head block's largest |value| in [2^13, 2^14), the
            # scores times 2^e (uq, with scale_log2). Exact for bf16 values down to 2^-31 of that largest (fp16's
            # subnormals hold 8 mantissa bits from 2^-17 on); below that a value is off by at most 2^-39 of the
            # largest: the scores by < 1e-6 of |k| |q| at their largest. One power for the block, not one per head
            # (kernels/decode_fp8.py's): a scalar, where a per-head one costs N / 4 registers a thread over the loop
            # (N = 64: it spilled). From the float32 exponent field E of the largest |value|: 2^-e = 2^(140 - E)
            # (field 267 - E), 2^e (field E - 13); E >= 14 (a zero block stays 0, NaN / inf stay NaN)
            q0 = G.load_rows(Qn, qn_rows, offs_c, mask_h, GW).to(gl.float32)
            q1 = G.load_rows(Qn + GW, qn_rows, offs_c, mask_h, GW).to(gl.float32)
            q2 = G.load_rows(Qn + 2 * GW, qn_rows, offs_c, mask_h, GW).to(gl.float32)
            q3 = G.load_rows(Qn + 3 * GW, qn_rows, offs_c, mask_h, GW).to(gl.float32)
            gl.static_assert(GROUPS == 4, "q's four groups")
            amax = gl.max(gl.maximum(gl.maximum(gl.max(gl.abs(q0), 1), gl.max(gl.abs(q1), 1)),
                                     gl.maximum(gl.max(gl.abs(q2), 1), gl.max(gl.abs(q3), 1))), 0)
            ex = gl.maximum((amax.to(gl.int32, bitcast=True) >> 23) & 255, 14)
            pre = ((267 - ex) << 23).to(gl.float32, bitcast=True)
            uq = ((ex - 13) << 23).to(gl.float32, bitcast=True) * scale_log2
            q_s = gl.allocate_shared_memory(gl.float16, [GROUPS, N, GW],
                                            gl.NVMMASharedLayout.get_default_for([N, GW], gl.float16))
            q_s.index(0).store((q0 * pre).to(gl.float16))
            q_s.index(1).store((q1 * pre).to(gl.float16))
            q_s.index(2).store((q2 * pre).to(gl.float16))
            q_s.index(3).store((q3 * pre).to(gl.float16))
            tdt: gl.constexpr = gl.float16  # the tile's and P^T's dtype
        else:
            uq = scale_log2  # unused
            q_s = gl.allocate_shared_memory(dt, [GROUPS, N, GW], gl.NVMMASharedLayout.get_default_for([N, GW], dt))
            for g in gl.static_range(GROUPS):
                q_s.index(g).store(G.load_rows(Qn + g * GW, qn_rows, offs_c, mask_h, GW))
            tdt: gl.constexpr = dt
        qp_s = gl.allocate_shared_memory(dt, [N, P], gl.NVMMASharedLayout.get_default_for([N, P], dt),
                                         G.load_rows(Qp, b * s_qpb + offs_h * s_qph, offs_p, mask_h, P))

        e_s = gl.allocate_shared_memory(e_dt, [STAGES * NB, BT, EB], e_l)
        sc_s = gl.allocate_shared_memory(s_dt, [STAGES, BT, GROUPS], s_l)
        r_s = gl.allocate_shared_memory(r_dt, [STAGES, BT, P], r_l)
        # P^T [64 tokens, N]: the P.V MMA's B operand, N-contiguous (MN-major, allowed for 16-bit types); EXACT: one
        # per group
        PL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BT, N], tdt)
        if EXACT:
            if P_ROPE:  # the four P^T tiles go into each tile's e4m3 boxes once converted (`_tile`): their bytes
                PPS: gl.constexpr = NB * BT * EB // (2 * BT * N)  # P^T tiles a slot holds
                gl.static_assert(PPS >= GROUPS, "four P^T tiles in a slot's e4m3 boxes")
                p_s = e_s._reinterpret(gl.float16, [STAGES * PPS, BT, N], PL)
                p1_s, p2_s, p3_s = p_s, p_s, p_s  # unused
            else:  # one allocation each ([1, 64, N]: indexed through the opaque 0 like the tile's groups)
                p_s = gl.allocate_shared_memory(gl.float16, [1, BT, N], PL)
                p1_s = gl.allocate_shared_memory(gl.float16, [1, BT, N], PL)
                p2_s = gl.allocate_shared_memory(gl.float16, [1, BT, N], PL)
                p3_s = gl.allocate_shared_memory(gl.float16, [1, BT, N], PL)
        else:
            if P_ROPE:  # P^T goes into each tile's rope slot (`_tile`); p_s only stands in for it in the arguments
                p_s = r_s.index(0)
            else:
                p_s = gl.allocate_shared_memory(dt, [BT, N], PL)
            p1_s, p2_s, p3_s = p_s, p_s, p_s  # unused
        dq_s = gl.allocate_shared_memory(tdt, [GROUPS, BT, GW], gl.NVMMASharedLayout.get_default_for([BT, GW], tdt))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):  # GATHER, TOKENS: every thread's copies arrive
            mbarrier.init(bars.index(j), count=32 * gl.num_warps() if GATHER else 1)
        fence_async_shared()  # q's stores and the barrier inits before any async-proxy access
        gl.thread_barrier()
        for j in gl.static_range(STAGES):
            if j < n_tiles:
                _fill_slot(src, bars.index(j), e_s, sc_s, r_s, j, Table, b, s_tb, start + j * BT, end, PS, GROUPS, GW,
                           SC_COL, RP_COL, GATHER, None, TOKENS)

        m_i = gl.full([N], float("-inf"), gl.float32, layout=gl.SliceLayout(0, S_L))  # running max per head
        l_i = gl.zeros([BT, N], gl.float32, layout=S_L)  # per-thread partial column sums (reduced once, at the end)
        acc0 = warpgroup_mma_init(gl.zeros([GW, N], gl.float32, layout=O_L))
        acc1 = warpgroup_mma_init(gl.zeros([GW, N], gl.float32, layout=O_L))
        acc2 = warpgroup_mma_init(gl.zeros([GW, N], gl.float32, layout=O_L))
        acc3 = warpgroup_mma_init(gl.zeros([GW, N], gl.float32, layout=O_L))
        # EXACT: acc_g is in units of top_g, the last tile's largest scale_g (`_tile`); 1 before the first tile
        top0 = gl.to_tensor(1.0)
        top1 = gl.to_tensor(1.0)
        top2 = gl.to_tensor(1.0)
        top3 = gl.to_tensor(1.0)

        # full tiles unmasked, then the split's partial last tile (if any) masked: two instances of one tile step, so
        # the full tiles carry no masking (and no branch whose common code would keep a whole group in registers)
        for i in range(n_full):
            m_i, l_i, acc0, acc1, acc2, acc3, top0, top1, top2, top3 = _tile(
                i, start, end, n_tiles, src, bars, e_s, sc_s, r_s, dq_s, q_s, qp_s, p_s, p1_s, p2_s,
                p3_s, Table, b,
                s_tb, scale_log2, uq, m_i, l_i, acc0, acc1, acc2, acc3, top0, top1, top2, top3, PS, STAGES, SC_COL,
                RP_COL, PRE, SLAB, P_ROPE, EXACT, S_L, O_L, CVT, False, GATHER, TOKENS)
        if n_full < n_tiles:
            m_i, l_i, acc0, acc1, acc2, acc3, top0, top1, top2, top3 = _tile(
                n_full, start, end, n_tiles, src, bars, e_s, sc_s, r_s, dq_s, q_s, qp_s, p_s, p1_s,
                p2_s, p3_s, Table, b,
                s_tb, scale_log2, uq, m_i, l_i, acc0, acc1, acc2, acc3, top0, top1, top2, top3, PS, STAGES, SC_COL,
                RP_COL, PRE, SLAB, P_ROPE, EXACT, S_L, O_L, CVT, True, GATHER, TOKENS)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=(acc0, acc1, acc2, acc3))
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(j))

        # normalised partial out and natural-log lse of this split (-inf, out 0, when it saw no token)
        lse, inv = G.column_softmax_end(m_i, l_i, O_L)
        oh = hb * N + gl.arange(0, N, layout=gl.SliceLayout(0, O_L))
        o_base = split.to(gl.int64) * s_on + b * s_ob + oh[None, :].to(gl.int64) * s_oh
        # (EXACT: acc_g times its unit top_g; else the tops stay 1)
        _store_group(O, acc0, inv * top0, o_base, oh, H, 0, GW, O_L)
        _store_group(O, acc1, inv * top1, o_base, oh, H, 1, GW, O_L)
        _store_group(O, acc2, inv * top2, o_base, oh, H, 2, GW, O_L)
        _store_group(O, acc3, inv * top3, o_base, oh, H, 3, GW, O_L)
        lh = hb * N + gl.arange(0, N, layout=gl.SliceLayout(0, S_L))
        gl.store(L + split * s_ln + b * s_lb + lh * s_lh, lse, mask=lh < H)




# ----------------------------------------------------------------------------------------------------------- host
@dataclasses.dataclass(frozen=True)
class Tiling:
    """One build of the kernel: N heads per program (the MMA's N), warps (4: one warpgroup; 8: two, the scores split
    by heads, P.V by channels), staging slots, PRE rows of scale group 0 converted before waiting for the previous
    P.V (0 or 64), SLAB rows per store into the 16-bit tile. P^T goes into the rope slot where shared memory needs
    it (N = 64)."""
    N: int
    warps: int
    stages: int
    pre: int = 64
    slab: int = 64
    exact: bool = True  # the kernel's EXACT (False: the bf16-rounding comparison variant, benchmarks/lab only)

    @property
    def p_rope(self) -> bool:
        return smem_bytes(self.N, self.stages, False, self.exact) > G.SMEM_LIMIT and self.N == P

    def constexprs(self, page_size: int, gather: bool = False, tokens: bool = False) -> dict:
        """The kernel's compile-time arguments for a form: TMA, GATHER or TOKENS (GATHER's machinery too); the
        other forms' EPtr / SPtr / RPtr are None (the TOKENS form takes them positionally: `run_stage1`)."""
        form = (dict(GATHER=True, TOKENS=True) if tokens else
                dict(GATHER=gather, TOKENS=False, EPtr=None, SPtr=None, RPtr=None))
        return dict(PS=page_size, N=self.N, WG=self.warps // 4, STAGES=self.stages, PRE=self.pre, SLAB=self.slab,
                    P_ROPE=self.p_rope, EXACT=self.exact, **form)


def smem_bytes(N: int, stages: int, p_rope: bool, exact: bool = True) -> int:
    """What one program's shared memory holds (compiled sizes, tools/aot: these + 16 N bytes of scratch for the
    softmax's cross-warp max): staging slots (e4m3 + scales + rope), the 16-bit tile, q, P^T (one per scale group
    with the exact scores; none of its own in the rope slot), barriers."""
    staging = BLOCK_T * (R + 4 * GROUPS + 2 * P)
    p_tiles = 0 if p_rope else (GROUPS if exact else 1) * 2 * BLOCK_T * N
    return stages * staging + 2 * BLOCK_T * R + 2 * N * (R + P) + p_tiles + 8 * stages + 16 * N


@functools.lru_cache(maxsize=None)
def default_tiling(H: int) -> Tiling:
    """N: the smallest of BLOCK_HS covering H (more heads: blocks of 64); one warpgroup at N = 16, two at 32 and 64
    (a [512, N] fp32 accumulator is 128 registers a thread at N = 32 over one warpgroup: it spills); as many staging
    slots as shared memory holds (3 at N = 16, 2 at 32 and 64). H200, the bf16-rounding build (RESULTS.md): 16:4:3
    88.5 us at H 16 B 8 32K against 100.2 at 8 warps."""
    N = next((n for n in BLOCK_HS if n >= H), BLOCK_HS[-1])
    stages = 3 if smem_bytes(N, 3, False) <= G.SMEM_LIMIT else 2
    return Tiling(N, 4 if N == 16 else 8, stages)


def fits(R_: int, P_: int, dtype: torch.dtype) -> bool:
    """The shapes this kernel takes: Gluon present, bf16 q, R 512, P 64 (the tile, box and accumulator sizes)."""
    return G.gluon is not None and dtype == torch.bfloat16 and R_ == R and P_ == P


def _box_view(t: torch.Tensor):
    """A cache view [NP, PS, X] as TMA slots [NP * PS, X] (`_util.tma_rows`: rows at a 16-byte multiple stride,
    16-byte aligned base, unit inner stride), or None."""
    NP, PS, X = t.shape
    return t.as_strided((NP * PS, X), (slot_stride(t), 1)) if tma_rows(t) else None


def eligible(ckv_cache, kpe_cache, ckv_scale) -> bool:
    """The cache layout this kernel reads: pages of whole 64-token tiles, each of the three views (fp8.views: e4m3
    values, float32 scales, rope) a run of TMA rows."""
    return (ckv_scale is not None and ckv_cache.shape[1] % BLOCK_T == 0 and ckv_scale.shape[-1] == GROUPS
            and all(_box_view(t) is not None for t in (ckv_cache, ckv_scale, kpe_cache)))


def _strides16(t: torch.Tensor):
    """A cache view [NP, PS, X] as rows of whole 16-byte chunks at 16-byte aligned addresses (unit inner stride, X
    elements a multiple of 16 bytes, 16-byte aligned base, page and token strides multiples of 16 bytes; a size-1
    dimension's stride is never used and counts 0): (page stride, token stride) in 16-byte units, or None."""
    es = t.element_size()
    if t.dim() != 3 or t.stride(2) != 1 or (t.shape[2] * es) % 16 or t.data_ptr() % 16:
        return None
    st = [0 if t.shape[d] == 1 else t.stride(d) * es for d in (0, 1)]
    return None if any(x % 16 or x < 0 for x in st) else (st[0] // 16, st[1] // 16)


def gather_eligible(ckv_cache, kpe_cache, ckv_scale) -> bool:
    """The cache layout the GATHER form reads (any page size: a page-size-1 token table, what the HF pass hands
    over): the three views (fp8.views: e4m3 values [.., 512], float32 scales [.., 4], bf16 rope [.., 64]) rows of
    whole 16-byte chunks at 16-byte aligned addresses (`_strides16`; fp8.views of a 16-byte aligned buffer: 656-byte
    tokens, 41 chunks)."""
    return (ckv_scale is not None and ckv_cache.dtype == fp8.DTYPE and ckv_scale.dtype == torch.float32
            and kpe_cache.dtype == torch.bfloat16 and ckv_cache.shape[-1] == R and ckv_scale.shape[-1] == GROUPS
            and kpe_cache.shape[-1] == P and ckv_cache.shape[:2] == ckv_scale.shape[:2] == kpe_cache.shape[:2]
            and all(_strides16(t) is not None for t in (ckv_cache, ckv_scale, kpe_cache)))


def token_rows(ckv_cache, kpe_cache, ckv_scale) -> bool:
    """The cache layout the TOKENS form reads: GATHER's (`gather_eligible`) at page size 1 (a token table's cache:
    the HF pass's) whose three views are TMA rows too (`_box_view`: fp8.views of a 16-byte aligned buffer are), so a
    tile of consecutive rows is the TMA form's boxes."""
    return (ckv_cache.shape[1] == 1 and gather_eligible(ckv_cache, kpe_cache, ckv_scale)
            and all(_box_view(t) is not None for t in (ckv_cache, ckv_scale, kpe_cache)))


@functools.lru_cache(maxsize=None)
def _layouts():
    # cached: get_default_for costs ~11 us a call on the host (kernels/_gluon.py _box_layouts)
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_T, E_BOX], gl.float8e4nv),  # 256-byte rows: 128B swizzle
            gl.NVMMASharedLayout.get_default_for([BLOCK_T, GROUPS], gl.float32),  # 16-byte rows: no swizzle
            gl.NVMMASharedLayout.get_default_for([BLOCK_T, P], gl.bfloat16))  # 128-byte rows: 128B swizzle


def descriptors(ckv_cache, ckv_scale, kpe_cache) -> list:
    """TMA descriptors over the three views as slots: e4m3 boxes [64, 256] (two scale groups), float32 [64, 4], bf16
    [64, 64]."""
    e_l, s_l, r_l = _layouts()
    return [TensorDescriptor.from_tensor(_box_view(ckv_cache), [BLOCK_T, E_BOX], e_l),
            TensorDescriptor.from_tensor(_box_view(ckv_scale), [BLOCK_T, GROUPS], s_l),
            TensorDescriptor.from_tensor(_box_view(kpe_cache), [BLOCK_T, P], r_l)]


def stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale, block_table, sm_scale, o, l, s_on, s_ln, ns,
                tiling: Tiling | None = None, tokens: bool | None = None):
    """What these tensors' signature fixes (o / l may be meta tensors: their strides are read): (the kernel bound to
    its grid and compile-time arguments, its descriptor templates or None for the GATHER form, the numbers after its
    tensor arguments, whether it is the TOKENS form); `run_stage1` launches it on a call's tensors. o [ns, B, H, 512]
    / l [ns, B, H] (s_on = s_ln = 0: the final out / lse with one split). The TMA form where the layout is
    `eligible`, else the GATHER form (`gather_eligible`), or over a token table (`token_rows`) the TOKENS form where
    `tokens` asks for it (None: MLA_COMPILE_SWAPAB_TOKENS, else this kernel's default: `TOKENS_IN_AUTO` for blocks
    of at most TOKENS_MAX_N heads; True on another layout: ValueError)."""
    B, H, _ = q_nope.shape
    t = tiling or default_tiling(H)
    grid = (B * cdiv(H, t.N), ns)
    views = (ckv_cache, ckv_scale, kpe_cache)
    gather = not eligible(ckv_cache, kpe_cache, ckv_scale)
    if gather and not gather_eligible(ckv_cache, kpe_cache, ckv_scale):
        raise ValueError("decode_fp8_swapab: the cache views are neither TMA rows in pages of whole 64-token tiles "
                         "nor 16-byte aligned rows (`eligible`, `gather_eligible`)")
    can = gather and token_rows(ckv_cache, kpe_cache, ckv_scale)
    if tokens and not can:
        raise ValueError("decode_fp8_swapab: the TOKENS form reads a page-size-1 cache under a token table whose views "
                         "are TMA rows (`token_rows`)")
    tokens = can and (_tuning.swapab_tokens(TOKENS_IN_AUTO and t.N <= TOKENS_MAX_N) if tokens is None else tokens)
    templates = None if gather and not tokens else without_bases(descriptors(ckv_cache, ckv_scale, kpe_cache))
    bound = bind(_fp8_swapab_kernel, grid, templates and templated_at(2, templates),
                 **t.constexprs(ckv_cache.shape[1], gather, tokens), num_warps=t.warps, **G.pdl_launch(q_nope.device))
    numbers = (sm_scale * G.LOG2E, H, q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
               block_table.stride(0), s_on, o.stride(-3), o.stride(-2), s_ln, l.stride(-2), l.stride(-1), ns,
               *(x for v in views for x in (_strides16(v) if gather else (0, 0))))
    return bound, templates, numbers, tokens


def run_stage1(plan, q_nope, q_pe, ckv_cache, kpe_cache, ckv_scale, block_table, seq_lens, o, l):
    bound, _, numbers, tokens = plan
    # the views themselves: pointers (GATHER), or the descriptors' bases (TMA: the bound launch holds the templates),
    # or both (TOKENS: the bases, then the row copies' pointers after the numbers)
    if tokens:
        return bound(q_nope, q_pe, ckv_cache, ckv_scale, kpe_cache, block_table, seq_lens, o, l, *numbers, ckv_cache,
                     ckv_scale, kpe_cache)
    return bound(q_nope, q_pe, ckv_cache, ckv_scale, kpe_cache, block_table, seq_lens, o, l, *numbers)
