"""Paged MLA decode over a bf16 / fp16 cache, stage 1, in Gluon for few heads: the warpgroup MMA's operands swapped so
that its M (64) is tokens, not heads.

Why: at 16 heads the decode is memory-bound, and what decides its speed is how the cache streams in. The Triton pointer
kernel (decode_stage1.py) copies each 64-token tile by 16-byte cp.async copies through per-token addresses and reaches
0.79-0.92 of copy bandwidth (H200, benchmarks/RESULTS.md); FlashMLA's TMA kernel, which pads 16 heads to a 64-row MMA,
0.88-1.02. Here each tile arrives as three TMA boxes (two latent halves [64, 256], the rope [64, 64]) on one mbarrier,
and both products are computed transposed, tokens x heads, so no MMA row is padding:

    S^T [64 tokens, N] = C0 [64, 256] . q0^T [256, N] + C1 . q1^T + Krope [64, 64] . q_rope^T
    O_h^T [256, N]    += C_h^T [256, 64 tokens] . P^T [64 tokens, N]        (h: the two latent halves)

A (the big operand) is the tile in shared memory as TMA wrote it: K-major for the scores, the same tile seen
transposed (MN-major, allowed for 16-bit types) for P.V, so nothing is converted or copied in shared memory (what
decode_fp8_swapab.py, the FP8 cache's kernel of the same shape, must do). B is q ([N, 576], loaded once) and P^T
([64, N]). The online softmax runs per head = per COLUMN of S^T (base 2); the row sums stay per thread and are reduced
once at the end.

One program per (request, block of N heads, KV split), grid (B * ceil(H / N), n_splits); N 16 (one warpgroup), 32 or
64 (two: the scores split by heads, P.V by channels). Shared memory: q 18-72 KB, two staging slots of 72 KB (a third
does not fit), P^T. A slot is refilled once the P.V that reads it has
retired (in the next tile, after its scores), with the page of the tile it takes loaded before the waits so the copy
never waits for the table. A split's partial last tile is a second instance of the tile step (MASKED): latent rows past
the end are zeroed before P.V reads them (unused slots may hold NaN), their scores -inf. Each split writes the
normalised partial out and natural-log lse (-inf for a split without tokens): the contract of every stage-1 kernel here,
so kernels/merge.py combines the splits.

TOKENS (PS 1: a token table, each entry a token's cache row; what the HF attention pass hands over, exact for any
mask): a tile is 64 table entries, not a page. They are loaded a tile ahead in a layout every warp holds whole, and two
in-warp reductions tell whether they are consecutive rows r0, r0 + 1, ... (a request's tokens in a static cache, at
any offset: a TMA box needs no tile alignment): then the same three TMA boxes at row r0, and one thread arrives for the
rest of the staging barrier's count (it counts every thread); any other tile is copied row by row, 16-byte cp.async
copies in slabs of 16 rows, each thread's copies arriving on the barrier when done. Either way the tile step waits on
one barrier per slot, as the paged form does.

Takes (`fits`, and `stage1_plan` checks the layout): sm_90, Gluon, fp16 / bf16, R 512 / P 64, one query token, a paged
cache whose pages are whole 64-token tiles viewing as [slots, width] (`_gluon.tma_layout`), or a page-size-1 cache
viewing so under a token table (`_gluon.token_rows`); `dispatch.select_decode_kernel` decides. Measured (H100,
benchmarks/RESULTS.md "The swap-AB kernel"): 0.88-1.04 of copy bandwidth from 32K tokens a request at B >= 8 (the Triton
pointer kernel 0.86-1.03 there, 0.58 at B 8 8K against 0.69 here), and at or below FlashInfer's and FlashMLA's time on
every H 16 shape of issue 24's grid.
"""

from __future__ import annotations

import dataclasses
import functools

from . import _gluon as G
from ._launch import bind, templated_at
from ._util import cdiv
from .merge import arrive, leave_group, merge_work, take_ticket, wait_for_group

if G.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)

R, P = 512, 64  # latent and rope widths this kernel takes
BLOCK_T = G.BLOCK_N  # tokens per tile: the MMA's M
# heads per program (the MMA's N) auto's tilings take: the smallest covering H. N 64 reads the cache once for 33-63
# heads where blocks of 32 read it twice: H 40 B 8 32K 116.9 against 142.4 us over pages of 64, 116.6 against 149.1
# over a token table (H100, benchmarks/RESULTS.md 2026-12-06); at 16 heads N 16 stays faster (107.7 vs 113.3 us)
BLOCK_HS = (16, 32, 64)
TILINGS = ((16, 4), (32, 8), (64, 8))  # every build a config may ask for
# the most splits a launch that merges its own splits takes (`merged_plan`); more take the merge launch. H100
# 2026-12-07 (benchmarks/RESULTS.md, twenty-second session), H 16 B 1, GPU us per eager call queued / wall us of
# back-to-back eager calls, two launches -> one: 16 splits (1K) 6.7 / 32.9 -> 10.4 / 16.0, 32 (2K) 7.2 / 23.0 ->
# 12.1 / 22.2, 64 (4K) 7.5 / 30.7 -> 19.1 / 19.2: from 64 the GPU pays what the host saves
MERGED_MAX_SPLITS = 32
STAGES = 2  # staging slots: a 64-token tile is 72 KB, a third slot passes Hopper's 227 KB
# The TOKENS form (page-size-1 token tables: the HF pass's) is auto's: alone it beats the Triton kernel on the HF
# layout (H100, H 16 B 8 32K 107.3 vs 116.1 us; B 1 16.7 vs 30.4), and the HF step with it (H 16 B 8 32K, hf_profile
# --ab 3, the op running this kernel) measured 820.7 vs 870.2 us (H100, benchmarks/RESULTS.md 2026-12-06).
# MLA_COMPILE_SWAPAB_TOKENS=0 takes it out of auto's table (tuning.swapab_tokens)
TOKENS_IN_AUTO = True


if G.gluon is not None:
    _STAGES = gl.constexpr(STAGES)

    @gluon.jit
    def _issue(CkvDesc, KpeDesc, bar, c0_s, c1_s, k_s, st, row):
        """TMA copies of the tile at cache row `row` into staging slot `st`, all on `bar`: the rope box first, then the
        two latent halves."""
        RH: gl.constexpr = CkvDesc.block_type.shape[1]
        mbarrier.expect(bar, 2 * CkvDesc.block_type.nbytes + KpeDesc.block_type.nbytes)
        tma.async_copy_global_to_shared(KpeDesc, [row, 0], bar, k_s.index(st))
        tma.async_copy_global_to_shared(CkvDesc, [row, 0], bar, c0_s.index(st))
        tma.async_copy_global_to_shared(CkvDesc, [row, RH], bar, c1_s.index(st))

    @gluon.jit
    def _row_of(Table, b, s_tb, t, PS: gl.constexpr):
        """The cache row of token t of request b (its tile lies inside one page)."""
        return gl.load(Table + b * s_tb + t // PS) * PS + t % PS

    @gluon.constexpr_function
    def _gather_layout(num_warps):
        """TOKENS' row copies: 16-byte chunks, 16 rows a repetition whatever the warps (a tile is 4 slabs of 16)."""
        return gl.BlockedLayout([1, 8], [16 // num_warps, 2 * num_warps], [num_warps, 1], [1, 0])

    @gluon.jit
    def _gather(Ckv, Kpe, s_cr, s_kr, bar, c0_s, c1_s, k_s, st, Table, b, s_tb, t0, end):
        """TOKENS, a tile whose rows are not consecutive: its rows into staging slot `st` by 16-byte cp.async copies,
        one slab of 16 rows at a time (the whole tile's pointers at once took ptxas past 255 registers), each
        thread's copies then arriving on `bar` (it counts every thread of the program). The slabs' table entries are
        loaded here: `_tile_rows` read the same 256 bytes a tile earlier (kept ahead as well, they spilled at 16
        heads). Tokens >= end: rows zero-filled, nothing read."""
        RH: gl.constexpr = c0_s.shape[2]
        P: gl.constexpr = k_s.shape[2]
        GL: gl.constexpr = _gather_layout(gl.num_warps())
        SLAB: gl.constexpr = 16
        oc = gl.arange(0, RH, layout=gl.SliceLayout(0, GL))[None, :]
        op = gl.arange(0, P, layout=gl.SliceLayout(0, GL))[None, :]
        for k in gl.static_range(c0_s.shape[1] // SLAB):
            valid = (t0 + k * SLAB + gl.arange(0, SLAB, layout=gl.SliceLayout(1, GL)) < end)[:, None]
            rows = G.table_entries(Table, b, s_tb, t0 + k * SLAB, end, SLAB, 1, gl.SliceLayout(1, GL))
            rows = rows.to(gl.int64)[:, None]
            async_copy.async_copy_global_to_shared(c0_s.index(st).slice(k * SLAB, SLAB, dim=0), Ckv + rows * s_cr + oc,
                                                   mask=valid)
            async_copy.async_copy_global_to_shared(c1_s.index(st).slice(k * SLAB, SLAB, dim=0),
                                                   Ckv + rows * s_cr + RH + oc, mask=valid)
            async_copy.async_copy_global_to_shared(k_s.index(st).slice(k * SLAB, SLAB, dim=0), Kpe + rows * s_kr + op,
                                                   mask=valid)
        async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _tile_rows(Table, b, s_tb, t0, end, BT: gl.constexpr, PS: gl.constexpr, CK: gl.constexpr):
        """What `_fill` needs of the table for the tile at t0, loaded a tile ahead so the copies never wait for it
        (the FP8 kernel's row copies with their entries loaded beside them took 1.6x the time: _fp8_swapab_tile
        `_gather_pages`): pages, the tile's first row; TOKENS, its entries in the check layout CK (a gathered tile
        reloads them from the cache lines this load brought in)."""
        if PS == 1:
            return G.table_entries(Table, b, s_tb, t0, end, BT, 1, CK)
        else:
            return _row_of(Table, b, s_tb, t0, PS)

    @gluon.jit
    def _fill(CkvDesc, KpeDesc, Ckv, Kpe, s_cr, s_kr, bar, c0_s, c1_s, k_s, st, Table, b, s_tb, t0, end, rows,
              PS: gl.constexpr):
        """The tile at token t0 into staging slot `st`, completing on `bar` (`rows`: what `_tile_rows` gave). Pages
        of whole tiles: TMA boxes at its first row. TOKENS (PS 1, a token table): its entries decide: consecutive
        rows (what a request's tokens in a static cache are: the HF pass's tables) are TMA boxes, and the rest of the
        barrier's count arrives at once; others are gathered row by row (`_gather`)."""
        if PS == 1:
            row0, run = G.run_start(rows, t0, end)
            if run:
                _issue(CkvDesc, KpeDesc, bar, c0_s, c1_s, k_s, st, row0)
                mbarrier.arrive(bar, count=32 * gl.num_warps() - 1)
            else:
                _gather(Ckv, Kpe, s_cr, s_kr, bar, c0_s, c1_s, k_s, st, Table, b, s_tb, t0, end)
        else:
            _issue(CkvDesc, KpeDesc, bar, c0_s, c1_s, k_s, st, rows)

    @gluon.jit
    def _zero_rows(buf, lim, LD: gl.constexpr):
        """Rows >= lim of a staged [64, width] tile set to 0 (generic-proxy stores: fence before an MMA reads them)."""
        rows = gl.arange(0, buf.shape[0], layout=gl.SliceLayout(1, LD))
        v = buf.load(LD)
        buf.store(gl.where((rows < lim)[:, None], v, gl.zeros_like(v)))

    @gluon.jit
    def _tile(i, start, end, n_tiles, CkvDesc, KpeDesc, Ckv, Kpe, s_cr, s_kr, bars, c0_s, c1_s, k_s, q0_s, q1_s, qp_s,
              p_s, Table, b, s_tb, scale_log2, m_i, l_i, acc0, acc1, PS: gl.constexpr, S_L: gl.constexpr,
              O_L: gl.constexpr, LD: gl.constexpr, CK: gl.constexpr, MASKED: gl.constexpr):
        """Tile i of the split (tokens start + 64 i ...): its scores, the online softmax, its P.V issued (left in
        flight for the next tile). MASKED: the split's partial last tile. Returns (m_i, l_i, acc0, acc1 in flight).

        Order: the page of the tile the freed slot takes is loaded -> wait for tile i's copies -> (MASKED: latent rows
        past the end zeroed) -> wait for the previous P.V (every warp: the barrier) -> scores issued and waited ->
        the previous slot refilled -> softmax -> P^T stored, fenced -> P.V issued. One wait with nothing left in
        flight per tile (waiting for part of a chain made ptxas serialise every wgmma in decode_fp8_swapab.py:
        C7514). The refill sits after the scores: issued between the barrier and the score MMAs, the copies made
        Triton 3.6's ptxas crash (SIGSEGV) on the two-instance build, and the one-instance build serialise the
        MMAs (C7515)."""
        BT: gl.constexpr = c0_s.shape[1]
        N: gl.constexpr = qp_s.shape[0]
        STAGES: gl.constexpr = c0_s.shape[0]
        st = i % STAGES
        refill = (i >= 1) & (i - 1 + STAGES < n_tiles)  # the previous tile's slot takes tile i - 1 + STAGES
        t_next = gl.where(refill, start + (i - 1 + STAGES) * BT, start)
        rows_next = _tile_rows(Table, b, s_tb, t_next, end, BT, PS, CK)
        lim = end - (start + i * BT)  # rows r < lim are tokens of this split (all 64 but on the partial last tile)
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        if MASKED:  # unused cache slots may hold NaN: P^T's zeros times them would be NaN
            _zero_rows(c0_s.index(st), lim, LD)
            _zero_rows(c1_s.index(st), lim, LD)
        if MASKED or PS == 1:  # the zeroed rows, TOKENS: a gathered tile's cp.async rows (generic-proxy writes)
            fence_async_shared()
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        gl.thread_barrier()  # every warp's P.V reads of the previous slot (and of p_s) retired
        s = warpgroup_mma(k_s.index(st), qp_s.permute((1, 0)), gl.zeros([BT, N], gl.float32, layout=S_L),
                          use_acc=False, is_async=True)
        s = warpgroup_mma(c0_s.index(st), q0_s.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma(c1_s.index(st), q1_s.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(0, deps=(s,))
        if refill:
            _fill(CkvDesc, KpeDesc, Ckv, Kpe, s_cr, s_kr, bars.index((i - 1) % STAGES), c0_s, c1_s, k_s,
                  (i - 1) % STAGES, Table, b, s_tb, t_next, end, rows_next, PS)
        s = s * scale_log2
        if MASKED:
            rows = gl.arange(0, BT, layout=gl.SliceLayout(1, S_L))
            s = gl.where((rows < lim)[:, None], s, float("-inf"))
        # online softmax per head (column), base 2
        m_new, alpha, p, l_i = G.column_softmax(s, m_i, l_i)
        p_s.store(p.to(p_s.dtype))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, O_L))[None, :]
        acc0 = warpgroup_mma(c0_s.index(st).permute((1, 0)), p_s, acc0 * alpha_o, is_async=True)
        acc1 = warpgroup_mma(c1_s.index(st).permute((1, 0)), p_s, acc1 * alpha_o, is_async=True)
        return m_new, l_i, acc0, acc1

    @gluon.jit
    def _store_half(O, acc, inv, o_base, oh, H, half: gl.constexpr, O_L: gl.constexpr):
        """out[h, half * RH + c] = acc[c, h] * inv[h] for this program's heads h < H (o_base [1, N]: their rows)."""
        RH: gl.constexpr = acc.shape[0]
        oc = gl.arange(0, RH, layout=gl.SliceLayout(1, O_L))
        gl.store(O + o_base + half * RH + oc[:, None], acc * inv[None, :], mask=(oh < H)[None, :] & (oc < RH)[:, None])

    @gluon.jit
    def _swapab_kernel(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L,
                       scale_log2, H,
                       s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb,
                       s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits,
                       PS: gl.constexpr, N: gl.constexpr, WG: gl.constexpr, PDL: gl.constexpr = False):
        """Stage 1 (module docstring). Qn [B, H, 512] / Qp [B, H, 64]; CkvDesc / KpeDesc: TMA descriptors over the
        caches as slots ([NP * PS, 512] in [64, 256] boxes, [NP * PS, 64] in [64, 64] boxes; Ckv / Kpe: the same
        caches as pointers, read by TOKENS' gathered tiles: the argument order of the other Gluon stage-1 kernels,
        decode_wgmma.run_stage1); Table int32 [B, max_pages] (PS 1: a token table, each token's cache row); Lens
        int32 [B]; O fp32 [n_splits, B, H, 512] and L fp32 [n_splits, B, H] (normalised partial out, natural-log lse;
        with one split the final out in q's dtype and lse, s_on = s_ln = 0). N heads per program, WG warpgroups."""
        G.pdl_enter(PDL)
        _swapab_program(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L, scale_log2, H, s_qnb, s_qnh, s_qpb,
                        s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits,
                        gl.program_id(0), gl.program_id(1), PS, N, WG)

    @gluon.jit
    def _swapab_merged_kernel(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L,
                              scale_log2, H,
                              s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb,
                              s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits,
                              C, Out, Lse, s_outb, s_outh, s_lseb, s_lseh, B, n_merge,
                              PS: gl.constexpr, N: gl.constexpr, WG: gl.constexpr, MERGE_N: gl.constexpr,
                              MERGE_R: gl.constexpr, MERGE_ONE_PASS: gl.constexpr, PDL: gl.constexpr = False):
        """`_swapab_kernel` and the merge of its splits in one launch (kernels/merge.py, "a split launch that merges
        itself"): grid (B * ceil(H / N) * n_splits + n_merge,), the first tickets stage-1 programs (in
        `_swapab_kernel`'s grid order), the rest merge items; O / L the partials, Out / Lse the final out and lse, C
        the zeroed counters."""
        G.pdl_enter(PDL)
        groups = B * gl.cdiv(H, N)
        ticket, is_split = take_ticket(C, groups * n_splits)
        if is_split:
            _swapab_program(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L, scale_log2, H, s_qnb, s_qnh, s_qpb,
                            s_qph, s_cp, s_cs, s_kp, s_ks, s_tb, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits,
                            ticket % groups, ticket // groups, PS, N, WG)
            arrive(C, ticket % groups)
        else:
            item = ticket - groups * n_splits
            bh, rb = wait_for_group(C, item, B, H, n_splits, N)
            G.merge_row_block(O, L, Out, Lse, bh, rb, n_splits, H, 2 * CkvDesc.block_type.shape[1], s_on, s_ob, s_oh,
                              s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb, s_lseh, MERGE_N, MERGE_R, MERGE_ONE_PASS)
            leave_group(C, item, n_merge, B, H, n_splits, N)

    @gluon.jit
    def _swapab_program(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L, scale_log2, H,
                        s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb,
                        s_on, s_ob, s_oh, s_ln, s_lb, s_lh, n_splits, pid, split,
                        PS: gl.constexpr, N: gl.constexpr, WG: gl.constexpr):
        """One `_swapab_kernel` program: (pid, split) of its grid."""
        gl.static_assert(gl.num_warps() == 4 * WG, "WG warpgroups")
        BT: gl.constexpr = CkvDesc.block_type.shape[0]
        RH: gl.constexpr = CkvDesc.block_type.shape[1]
        P: gl.constexpr = KpeDesc.block_type.shape[1]
        gl.static_assert(PS % BT == 0 or PS == 1, "a tile lies inside one page, or PS 1: a token table (TOKENS)")
        dt: gl.constexpr = CkvDesc.dtype
        STAGES: gl.constexpr = _STAGES
        # scores [64 tokens, N]: one warpgroup's m64 over the tokens; with two warpgroups each takes half the heads
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, WG],
                                                      instr_shape=[16, N // WG, 16])
        # O^T half [256 channels, N]: warpgroups along the channels (m64 blocks), each with every head
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4 * WG, 1],
                                                      instr_shape=[16, N, 16])
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4 * WG, 1], [1, 0])  # 16-byte loads and stores
        CK: gl.constexpr = G.run_layout(4 * WG)  # TOKENS: a tile's 64 table entries, for `_gluon.run_start`

        b, hb, split, start, end, n_full, n_tiles = G.swapab_program(Lens, H, n_splits, pid, split, N,
                                                                            BT)

        q0_s, q1_s, qp_s = G.q_to_smem(Qn, Qp, b, hb, H, s_qnb, s_qnh, s_qpb, s_qph, dt, RH, P, N, LD)
        c0_s = gl.allocate_shared_memory(dt, [STAGES, BT, RH], CkvDesc.layout)
        c1_s = gl.allocate_shared_memory(dt, [STAGES, BT, RH], CkvDesc.layout)
        k_s = gl.allocate_shared_memory(dt, [STAGES, BT, P], KpeDesc.layout)
        # P^T [64 tokens, N]: P.V's B operand, N-contiguous (MN-major, allowed for 16-bit types)
        p_s = gl.allocate_shared_memory(dt, [BT, N], gl.NVMMASharedLayout.get_default_for([BT, N], dt))
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for j in gl.static_range(STAGES):  # TOKENS: a gathered tile's copies arrive from every thread
            mbarrier.init(bars.index(j), count=32 * gl.num_warps() if PS == 1 else 1)
        fence_async_shared()  # q's stores and the barrier inits before any async-proxy access
        gl.thread_barrier()
        for j in gl.static_range(STAGES):
            if j < n_tiles:
                t0 = start + j * BT
                _fill(CkvDesc, KpeDesc, Ckv, Kpe, s_cp, s_kp, bars.index(j), c0_s, c1_s, k_s, j, Table, b, s_tb, t0,
                      end, _tile_rows(Table, b, s_tb, t0, end, BT, PS, CK), PS)

        m_i = gl.full([N], float("-inf"), gl.float32, layout=gl.SliceLayout(0, S_L))  # running max per head
        l_i = gl.zeros([BT, N], gl.float32, layout=S_L)  # per-thread partial column sums (reduced once, at the end)
        acc0 = warpgroup_mma_init(gl.zeros([RH, N], gl.float32, layout=O_L))
        acc1 = warpgroup_mma_init(gl.zeros([RH, N], gl.float32, layout=O_L))
        # full tiles unmasked, then the split's partial last tile (if any) masked: two instances of one tile step
        for i in range(n_full):
            m_i, l_i, acc0, acc1 = _tile(i, start, end, n_tiles, CkvDesc, KpeDesc, Ckv, Kpe, s_cp, s_kp, bars, c0_s,
                                         c1_s, k_s, q0_s, q1_s, qp_s, p_s, Table, b, s_tb, scale_log2, m_i, l_i, acc0,
                                         acc1, PS, S_L, O_L, LD, CK, False)
        if n_full < n_tiles:
            m_i, l_i, acc0, acc1 = _tile(n_full, start, end, n_tiles, CkvDesc, KpeDesc, Ckv, Kpe, s_cp, s_kp, bars,
                                         c0_s, c1_s, k_s, q0_s, q1_s, qp_s, p_s, Table, b, s_tb, scale_log2, m_i, l_i,
                                         acc0, acc1, PS, S_L, O_L, LD, CK, True)
        acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        for j in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(j))

        # normalised partial out and natural-log lse of this split (-inf, out 0, when it saw no token)
        lse, inv = G.column_softmax_end(m_i, l_i, O_L)
        oh = hb * N + gl.arange(0, N, layout=gl.SliceLayout(0, O_L))
        o_base = split.to(gl.int64) * s_on + b * s_ob + oh[None, :].to(gl.int64) * s_oh
        _store_half(O, acc0, inv, o_base, oh, H, 0, O_L)
        _store_half(O, acc1, inv, o_base, oh, H, 1, O_L)
        lh = hb * N + gl.arange(0, N, layout=gl.SliceLayout(0, S_L))
        gl.store(L + split * s_ln + b * s_lb + lh * s_lh, lse, mask=lh < H)


# ----------------------------------------------------------------------------------------------------------- host
@dataclasses.dataclass(frozen=True)
class Tiling:
    """One build of the kernel: N heads per program (the MMA's N) and its warps (4: one warpgroup; 8: two, the scores
    split by heads, P.V by channels)."""
    N: int
    warps: int

    @property
    def stages(self) -> int:
        """Staging slots: fixed (`STAGES`, what shared memory holds), a property so `dispatch._config` reads every
        swap-AB tiling alike."""
        return STAGES

    def constexprs(self, page_size: int) -> dict:
        return dict(PS=page_size, N=self.N, WG=self.warps // 4)


def smem_bytes(N: int, itemsize: int = 2) -> int:
    """One program's shared memory: q, the staging slots, P^T, barriers."""
    return itemsize * (N * (R + P) + STAGES * BLOCK_T * (R + P) + BLOCK_T * N) + 8 * STAGES


@functools.lru_cache(maxsize=None)
def default_tiling(H: int) -> Tiling:
    """N: the smallest of BLOCK_HS covering H (more heads: blocks of 64); one warpgroup at N = 16, two from 32."""
    N = next((n for n in BLOCK_HS if n >= H), BLOCK_HS[-1])
    return Tiling(N, 4 if N == 16 else 8)


def fits(R_: int, P_: int) -> bool:
    """The shapes this kernel takes: Gluon present, R 512, P 64 (the box and accumulator sizes)."""
    return G.gluon is not None and R_ == R and P_ == P and smem_bytes(BLOCK_HS[-1]) <= G.SMEM_LIMIT


def stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, sm_scale, o, l, s_on, s_ln, ns,
                tiling: Tiling | None = None):
    """decode_wgmma.stage1_plan's contract for this kernel (pages of whole tiles or a token table, one query token):
    (the kernel bound to its grid and compile-time arguments, its descriptor templates, the numbers after its tensor
    arguments); run it with decode_wgmma.run_stage1. o [ns, B, H, 512] / l [ns, B, H] may be meta tensors (their
    strides are read). tiling: one of TILINGS (default: `default_tiling(H)`)."""
    B, H, _ = q_nope.shape
    if tiling is not None and (tiling.N, tiling.warps) not in TILINGS:
        raise ValueError(f"decode_swapab: tiling {tiling} is none of the builds (N, warps) in {TILINGS}")
    if not (G.tma_layout(ckv_cache, kpe_cache, False) or G.token_rows(ckv_cache, kpe_cache, False)):
        raise ValueError("decode_swapab: the caches must view as [slots, width] in pages of whole 64-token tiles "
                         "(`_gluon.tma_layout`) or of one token (a token table, `_gluon.token_rows`)")
    t = tiling or default_tiling(H)
    templates = G.descriptor_templates(ckv_cache, kpe_cache)
    bound = bind(_swapab_kernel, (B * cdiv(H, t.N), ns), templated_at(2, templates),
                 **t.constexprs(ckv_cache.shape[1]), num_warps=t.warps, **G.pdl_launch(q_nope.device))
    numbers = (sm_scale * G.LOG2E, H, *G.strides(q_nope, q_pe, ckv_cache, kpe_cache, block_table, o, l, s_on, s_ln,
                                                  ns))
    return bound, templates, numbers


def merged_plan(plan, q_nope, ckv_cache, ns, out, lse, tiling: Tiling | None = None):
    """`stage1_plan`'s kernel (`plan`: its answer for this call) merging its own splits in the same launch
    (`_swapab_merged_kernel`; kernels/merge.py, "a split launch that merges itself"): (bound, merge numbers, counter
    slots), or None over MERGED_MAX_SPLITS splits or where it would not fit one wave (`merge.merge_work`). Launch
    `bound(<run_stage1's arguments>, counters, out, lse, *merge numbers)`; out [B, H, 512] / lse [B, H] may be meta
    tensors. The same descriptor templates and numbers as `plan`."""
    B, H, _ = q_nope.shape
    t = tiling or default_tiling(H)
    work = merge_work(ns, out, lse, B * cdiv(H, t.N), q_nope.device) if ns <= MERGED_MAX_SPLITS else None
    if work is None:
        return None
    work, tail, slots, programs = work
    bound = bind(_swapab_merged_kernel, (programs,), templated_at(2, plan[1]), **t.constexprs(ckv_cache.shape[1]),
                 **work, num_warps=t.warps, **G.pdl_launch(q_nope.device))
    return bound, tail, slots
