"""Many-head paged MLA decode, stage 1, in Gluon: Hopper warpgroup MMAs with their layouts chosen by hand.

Why not the Triton kernel (decode.py `_stage1_tma_kernel`): for the score tile s = q.ckv^T of [64 heads, 64
tokens], Triton 3.6 lays the MMA out as 8 warps along M (TTGIR: warpsPerCTA [8, 1], instr n = 32), so BOTH
warpgroups compute the same scores, each reading q and the tile from shared memory at 3 KB per 16-clock
instruction: 1.5x the tensor work at three times what shared memory serves. H=128 stayed at ~27% of the
H200's peak (274 TFLOP/s, benchmarks/RESULTS.md, the Gluon kernel). Here the two warpgroups split the score tile
by tokens (warps [4, 2]) and the output by columns, so every product is computed once.

One program per (request, block of 64 heads, KV split), 8 warps. Shared memory holds q (latent halves + rope,
loaded once) and STAGES tiles of 64 tokens (the next tile loads while this one computes); p goes through shared
memory to feed the second MMA from both warpgroups. Two kernels share those MMAs and differ in how a tile arrives:
- `_stage1_wgmma_kernel`: TMA boxes (pages of whole 64-token tiles); a split's partial last tile by masked loads;
- `_stage1_gather_kernel`: 16-byte async copies per token row through the table (pages smaller than a tile, sparse
  index lists), masked rows zero-filled.
Slots past seq_len may hold NaN and never reach an MMA. Both write the same normalised partial out and natural-log
lse as the Triton kernels, so decode.py's merge is shared. `launch` takes the TMA kernel where the cache layout
allows it (`_gluon.tma_layout`), else the gather kernel; whether this file's kernels run at all is
`dispatch.select_decode_kernel`'s decision ("wgmma"; on the TMA layout with rope width 64 it prefers
decode_seesaw.py's warp-specialised kernel, "seesaw").

Several query tokens per request (MTP, speculative verification) fold into the rows, each row masked at its own
causal limit (MULTI; `_gluon.row_limits`): a 64-row block then holds e.g. 4 tokens of 16 heads, and each KV tile is
read once for all of them.

Needs sm_90 exactly (warpgroup MMA is Hopper's; Blackwell has tcgen05 instead), bf16 / fp16, >= 64 heads (or >= 32
rows of several query tokens) and the latent in two power-of-two halves: see `fits`. Measured: benchmarks/RESULTS.md
(the Gluon kernel, the gather kernel).
"""

from __future__ import annotations


from . import _gluon as G
from ._util import box_width, cdiv, query_limit_args
from ._launch import bind, templated_at

if G.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                                  warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

BLOCK_H = G.BLOCK_H
BLOCK_N = G.BLOCK_N
STAGES = 2
NUM_WARPS = 8  # two warpgroups


def smem_bytes(R: int, P: int, itemsize: int = 2) -> int:
    """q + STAGES KV tiles + p (+ barriers): what one program allocates."""
    return itemsize * (BLOCK_H * (R + P) + STAGES * BLOCK_N * (R + P) + BLOCK_H * BLOCK_N) + 64


def fits(R: int, P: int) -> bool:
    """The shapes these kernels take: latent halves and rope widths that are powers of two a TMA box / an MMA / a
    16-byte copy accept, and the tiles fitting shared memory (Gluon present)."""
    return (G.gluon is not None and R % 2 == 0 and box_width(R // 2) and box_width(P)
            and smem_bytes(R, P) <= G.SMEM_LIMIT)


def gather_fits(R: int, P: int) -> bool:
    """The gather kernel's extra need: rows it copies in whole 16-byte pieces per thread (its load layout)."""
    return R // 2 >= 64 and P >= 64


if G.gluon is not None:

    @gluon.jit
    def _scores(q0_s, q1_s, qp_s, c0_t, c1_t, k_t, s0):
        """s = q.[c0 | c1 | k]^T for the tile in shared memory, issued asynchronously (wait before use); s0 is a
        score-shaped tensor in the score layout (its values are ignored)."""
        s = warpgroup_mma(q0_s, c0_t.permute((1, 0)), s0, use_acc=False, is_async=True)
        s = warpgroup_mma(q1_s, c1_t.permute((1, 0)), s, is_async=True)
        return warpgroup_mma(qp_s, k_t.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _softmax_pv(s, c0_t, c1_t, p_s, mask, m_i, l_i, acc0, acc1, scale_log2, MASKED: gl.constexpr,
                    O_L: gl.constexpr, ASYNC_PV: gl.constexpr):
        """The online-softmax step on the tile's scores s, then acc += p.[c0 | c1] (left in flight if ASYNC_PV: wait
        before use). `mask` (MASKED): which scores count, broadcastable to s ([1, BLOCK_N] for one limit per tile,
        [BLOCK_H, BLOCK_N] for a limit per row). l_i is kept score-shaped, each thread summing its own columns: the
        row sums need no cross-warp reduction until the end."""
        s = s * scale_log2
        if MASKED:
            s = gl.where(mask, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # a tile of only masked slots stays NaN-free
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[:, None])
        l_i = l_i * alpha[:, None] + p
        # p feeds the second MMA from shared memory: each warpgroup holds half its columns. No warpgroup can be
        # here while the other's previous p.ckv still reads p_s: the row max above is a cross-warpgroup
        # reduction, and every warp waited for its previous MMAs before it
        p_s.store(p.to(p_s.dtype))
        fence_async_shared()
        gl.thread_barrier()
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc0 = acc0 * alpha_o
        acc1 = acc1 * alpha_o
        acc0 = warpgroup_mma(p_s, c0_t, acc0, is_async=True)
        acc1 = warpgroup_mma(p_s, c1_t, acc1, is_async=True)
        if not ASYNC_PV:
            acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))
        return m_new, l_i, acc0, acc1

    @gluon.jit
    def _issue_tile(desc_c, desc_k, bar, c0_t, c1_t, k_t, Table, b, s_tb, t0, PS: gl.constexpr, RH: gl.constexpr):
        """TMA loads of the whole tile starting at token t0 (inside one page) into one stage."""
        page = gl.load(Table + b * s_tb + t0 // PS)
        row = page * PS + t0 % PS
        mbarrier.expect(bar, 2 * desc_c.block_type.nbytes + desc_k.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_c, [row, 0], bar, c0_t)
        tma.async_copy_global_to_shared(desc_c, [row, RH], bar, c1_t)
        tma.async_copy_global_to_shared(desc_k, [row, 0], bar, k_t)

    @gluon.jit
    def _store_partial(O, L, b, hb, split, H, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, m_i, l_i, acc0, acc1,
                       RH: gl.constexpr, BLOCK_H: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr):
        """This split's normalised out and natural-log lse (-inf, out 0 when it saw no token); l_i is the
        score-shaped per-thread partial row sums."""
        l_i = gl.sum(l_i, 1)
        has = l_i > 0
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        inv = gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), gl.SliceLayout(1, O_L))[:, None]
        oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        orr = gl.arange(0, RH, layout=gl.SliceLayout(0, O_L))
        o_ptr = O + split.to(gl.int64) * s_on + b * s_ob + oh[:, None] * s_oh + orr[None, :]
        o_mask = (oh < H)[:, None] & (orr < RH)[None, :]
        gl.store(o_ptr, acc0 * inv, mask=o_mask)
        gl.store(o_ptr + RH, acc1 * inv, mask=o_mask)
        lh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, S_L))
        gl.store(L + split * s_ln + b * s_lb + lh * s_lh, lse, mask=lh < H)

    @gluon.jit
    def _stage1_wgmma_kernel(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L,
                             scale_log2, H,
                             s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb,
                             s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                             n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                             PS: gl.constexpr, RH: gl.constexpr, P: gl.constexpr,
                             BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                             MULTI: gl.constexpr = False, PDL: gl.constexpr = False):
        """MULTI: several query tokens per request folded into the rows, each row with its own limit
        (`_gluon.query_rows`): every tile is masked per row. Else one length per request, full tiles unmasked."""
        G.pdl_enter(PDL)
        gl.static_assert(gl.num_warps() == 8, "two warpgroups")
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_N // 2, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, RH // 2, 16])
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte global loads
        dt: gl.constexpr = CkvDesc.dtype

        hb = gl.program_id(0)  # fastest: a tile's head blocks run on neighbouring SMs and share its L2 copy
        b = gl.program_id(1).to(gl.int64)
        split = gl.program_id(2)
        if MULTI:
            n, limit = G.query_rows(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal,
                                    gl.SliceLayout(1, S_L), BLOCK_H)
        else:
            n = gl.load(Lens + b)
        start, end, n_full = G.split_bounds(n, split, n_splits, BLOCK_N)
        q0_s, q1_s, qp_s = G.q_to_smem(Qn, Qp, b, hb, H, s_qnb, s_qnh, s_qpb, s_qph, dt, RH, P, BLOCK_H, LD)
        p_s = gl.allocate_shared_memory(dt, [BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for(
            [BLOCK_H, BLOCK_N], dt))
        c0_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, RH], CkvDesc.layout)
        c1_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, RH], CkvDesc.layout)
        k_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, P], KpeDesc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(bars.index(i), count=1)
        fence_async_shared()  # q's stores and the barrier inits before any async-proxy access
        gl.thread_barrier()

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)  # per-thread partial row sums
        acc0 = gl.zeros([BLOCK_H, RH], gl.float32, layout=O_L)
        acc1 = gl.zeros([BLOCK_H, RH], gl.float32, layout=O_L)
        no_mask = gl.full([1, BLOCK_N], 1, gl.int1, layout=S_L)
        tile_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        s0 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)

        # the accumulators stay in flight from one tile's p.ckv into the next tile's q.ckv^T (waiting for p.ckv per
        # tile instead: stage 1 677 / 2723 vs 661 / 2649 us at B=8 128K / B=128 32K, H200, benchmarks/RESULTS.md)
        acc0 = warpgroup_mma_init(acc0)
        acc1 = warpgroup_mma_init(acc1)
        if n_full > 0:
            _issue_tile(CkvDesc, KpeDesc, bars.index(0), c0_s.index(0), c1_s.index(0), k_s.index(0), Table, b,
                        s_tb, start, PS, RH)
        if n_full > 1:
            _issue_tile(CkvDesc, KpeDesc, bars.index(1), c0_s.index(1), c1_s.index(1), k_s.index(1), Table, b,
                        s_tb, start + BLOCK_N, PS, RH)
        for i in range(n_full):
            st = i % STAGES
            nx = (i + 1) % STAGES
            mbarrier.wait(bars.index(st), (i // STAGES) & 1)
            s = _scores(q0_s, q1_s, qp_s, c0_s.index(st), c1_s.index(st), k_s.index(st), s0)
            # tile i - 1's p.ckv ran ahead of these scores on the tensor cores; both are done after the wait, so
            # (after the barrier: all warps) tile i - 1's stage takes tile i + 1. (Starting that copy as soon as
            # p.ckv is done, before the scores complete, was slower: 754 vs 661 us on the H200.)
            s, acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(s, acc0, acc1))
            if (i >= 1) & (i + 1 < n_full):
                gl.thread_barrier()
                _issue_tile(CkvDesc, KpeDesc, bars.index(nx), c0_s.index(nx), c1_s.index(nx), k_s.index(nx),
                            Table, b, s_tb, start + (i + 1) * BLOCK_N, PS, RH)
            if MULTI:
                mask = (start + i * BLOCK_N + tile_t)[None, :] < limit[:, None]
            else:
                mask = no_mask
            m_i, l_i, acc0, acc1 = _softmax_pv(s, c0_s.index(st), c1_s.index(st), p_s, mask, m_i, l_i, acc0, acc1,
                                               scale_log2, MULTI, O_L, True)
        acc0, acc1 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1))

        t0 = start + n_full * BLOCK_N
        if t0 < end:  # the partial last tile: masked loads into stage 0, once every warp's MMAs above have completed
            gl.thread_barrier()
            offs_t = t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LD))
            offs_r = gl.arange(0, RH, layout=gl.SliceLayout(0, LD))
            offs_p = gl.arange(0, P, layout=gl.SliceLayout(0, LD))
            valid = offs_t < end
            page = gl.load(Table + b * s_tb + t0 // PS).to(gl.int64)  # the tile lies in one page
            crow = page * s_cp + (offs_t % PS) * s_cs
            c0_s.index(0).store(G.load_rows(Ckv, crow, offs_r, valid, RH))
            c1_s.index(0).store(G.load_rows(Ckv + RH, crow, offs_r, valid, RH))
            k_s.index(0).store(G.load_rows(Kpe, page * s_kp + (offs_t % PS) * s_ks, offs_p, valid, P))
            fence_async_shared()
            gl.thread_barrier()
            mask = ((t0 + tile_t) < end)[None, :]
            if MULTI:
                mask = mask & ((t0 + tile_t)[None, :] < limit[:, None])
            s = _scores(q0_s, q1_s, qp_s, c0_s.index(0), c1_s.index(0), k_s.index(0), s0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            m_i, l_i, acc0, acc1 = _softmax_pv(s, c0_s.index(0), c1_s.index(0), p_s, mask, m_i, l_i, acc0, acc1,
                                               scale_log2, True, O_L, False)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(i))

        _store_partial(O, L, b, hb, split, H, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, m_i, l_i, acc0, acc1, RH, BLOCK_H,
                       S_L, O_L)

    @gluon.jit
    def _token_rows(Table, b, s_tb, t0, end, layout: gl.constexpr, PS: gl.constexpr, BLOCK_N: gl.constexpr,
                    SPARSE: gl.constexpr):
        """For tokens [t0, t0 + BLOCK_N) in `layout`: (page, row in page, valid). Paged: through the block table;
        SPARSE: Table is the index list of physical slots (-1 = none). Invalid tokens get page 0, row 0."""
        offs_t = t0 + gl.arange(0, BLOCK_N, layout=layout)
        valid = offs_t < end
        if SPARSE:
            slot = gl.load(Table + b * s_tb + offs_t, mask=valid, other=-1)
            valid = valid & (slot >= 0)
            slot = gl.maximum(slot, 0)
            page = (slot // PS).to(gl.int64)
            off = slot % PS
        else:
            page = gl.load(Table + b * s_tb + offs_t // PS, mask=valid, other=0).to(gl.int64)
            off = offs_t % PS
        return page, off, valid

    @gluon.jit
    def _gather_tile(c0_t, c1_t, k_t, Ckv, Kpe, page, off, valid, s_cp, s_cs, s_kp, s_ks, RH: gl.constexpr,
                     P: gl.constexpr, LD: gl.constexpr):
        """16-byte async copies of a tile's token rows (page, off, valid: `_token_rows` in SliceLayout(1, LD)) into
        one stage, as one commit group; invalid tokens' rows are zero-filled, never read (unused cache slots may hold
        NaN)."""
        crow = (page * s_cp + off * s_cs)[:, None]
        krow = (page * s_kp + off * s_ks)[:, None]
        offs_r = gl.arange(0, RH, layout=gl.SliceLayout(0, LD))[None, :]
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(0, LD))[None, :]
        m = valid[:, None]
        async_copy.async_copy_global_to_shared(c0_t, Ckv + crow + offs_r, mask=m)
        async_copy.async_copy_global_to_shared(c1_t, Ckv + RH + crow + offs_r, mask=m)
        async_copy.async_copy_global_to_shared(k_t, Kpe + krow + offs_p, mask=m)
        async_copy.commit_group()

    @gluon.jit
    def _stage1_gather_kernel(Qn, Qp, Ckv, Kpe, Table, Lens, O, L,
                              scale_log2, H, n_sparse,
                              s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb,
                              s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                              n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                              SPARSE: gl.constexpr, PS: gl.constexpr, RH: gl.constexpr, P: gl.constexpr,
                              BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                              MULTI: gl.constexpr = False, PDL: gl.constexpr = False):
        """The same MMAs for tiles that are not TMA boxes: pages smaller than a tile (a page-1 token table, page 16)
        and sparse index lists (`mla::sparse_decode`). Each token's row comes by a 16-byte async copy (cp.async)
        through the table; tile i + 1's copies run while tile i computes. MULTI (paged only): a limit per row, as
        in the TMA kernel."""
        G.pdl_enter(PDL)
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, BLOCK_N // 2, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                      instr_shape=[16, RH // 2, 16])
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [8, 1], [1, 0])  # 16-byte copies
        dt: gl.constexpr = Ckv.dtype.element_ty

        hb = gl.program_id(0)
        b = gl.program_id(1).to(gl.int64)
        split = gl.program_id(2)
        if SPARSE:
            n = n_sparse
        elif MULTI:
            n, limit = G.query_rows(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal,
                                    gl.SliceLayout(1, S_L), BLOCK_H)
        else:
            n = gl.load(Lens + b)
        start, end, n_full = G.split_bounds(n, split, n_splits, BLOCK_N)
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)  # the partial last tile too: masks handle it
        q0_s, q1_s, qp_s = G.q_to_smem(Qn, Qp, b, hb, H, s_qnb, s_qnh, s_qpb, s_qph, dt, RH, P, BLOCK_H, LD)
        p_s = gl.allocate_shared_memory(dt, [BLOCK_H, BLOCK_N], gl.NVMMASharedLayout.get_default_for(
            [BLOCK_H, BLOCK_N], dt))
        c_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RH], dt)
        k_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, P], dt)
        c0_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, RH], c_sl)
        c1_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, RH], c_sl)
        k_s = gl.allocate_shared_memory(dt, [STAGES, BLOCK_N, P], k_sl)
        fence_async_shared()
        gl.thread_barrier()

        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=gl.SliceLayout(1, S_L))
        l_i = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
        acc0 = gl.zeros([BLOCK_H, RH], gl.float32, layout=O_L)
        acc1 = gl.zeros([BLOCK_H, RH], gl.float32, layout=O_L)
        s0 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)

        ROWS: gl.constexpr = gl.SliceLayout(1, LD)
        if n_tiles > 0:
            page, off, valid = _token_rows(Table, b, s_tb, start, end, ROWS, PS, BLOCK_N, SPARSE)
            _gather_tile(c0_s.index(0), c1_s.index(0), k_s.index(0), Ckv, Kpe, page, off, valid, s_cp, s_cs, s_kp,
                         s_ks, RH, P, LD)
        # the table entries of the tile whose copies an iteration issues are loaded an iteration earlier: loaded
        # right before their copies, every tile waited for the table's latency before its copies and MMAs were
        # issued (H100, H 128 B 8 32K over a page-size-1 token table: 199.9 -> 184.0 us, the TMA kernels on pages of
        # 64 181.6; benchmarks/RESULTS.md 2026-12-05); past the end they are masked (no load)
        page, off, valid = _token_rows(Table, b, s_tb, start + BLOCK_N, end, ROWS, PS, BLOCK_N, SPARSE)
        for i in range(n_tiles):
            st = i % STAGES
            nx = (i + 1) % STAGES
            page2, off2, valid2 = _token_rows(Table, b, s_tb, start + (i + 2) * BLOCK_N, end, ROWS, PS, BLOCK_N,
                                              SPARSE)
            # tile i + 1 goes into the stage tile i - 1 used: every warp waited for its MMAs, the barrier for all
            gl.thread_barrier()
            if i + 1 < n_tiles:
                _gather_tile(c0_s.index(nx), c1_s.index(nx), k_s.index(nx), Ckv, Kpe, page, off, valid, s_cp, s_cs,
                             s_kp, s_ks, RH, P, LD)
            else:
                async_copy.commit_group()  # an empty group: "all but the newest group" stays tile i's
            page, off, valid = page2, off2, valid2
            async_copy.wait_group(1)
            fence_async_shared()  # this thread's copies -> visible to the MMAs (async proxy), then all threads'
            gl.thread_barrier()
            t0 = start + i * BLOCK_N
            _, _, valid_s = _token_rows(Table, b, s_tb, t0, end, gl.SliceLayout(0, S_L), PS, BLOCK_N, SPARSE)
            mask = valid_s[None, :]
            if MULTI:
                mask = mask & ((t0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L)))[None, :] < limit[:, None])
            s = _scores(q0_s, q1_s, qp_s, c0_s.index(st), c1_s.index(st), k_s.index(st), s0)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
            m_i, l_i, acc0, acc1 = _softmax_pv(s, c0_s.index(st), c1_s.index(st), p_s, mask, m_i, l_i, acc0, acc1,
                                               scale_log2, True, O_L, False)
        async_copy.wait_group(0)
        _store_partial(O, L, b, hb, split, H, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, m_i, l_i, acc0, acc1, RH, BLOCK_H,
                       S_L, O_L)


def constexprs(R: int, P: int, page_size: int, multi: bool = False) -> dict:
    """The TMA kernel's compile-time arguments (shared with tools/aot.py's codegen check)."""
    return dict(PS=page_size, RH=R // 2, P=P, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, STAGES=STAGES, MULTI=multi)


def gather_constexprs(R: int, P: int, page_size: int, sparse: bool, multi: bool = False) -> dict:
    """The gather kernel's compile-time arguments (shared with tools/aot.py's codegen check)."""
    return dict(SPARSE=sparse, PS=page_size, RH=R // 2, P=P, BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N, STAGES=STAGES,
                MULTI=multi)


def stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns,
                indices=None, n_query: int = 1):
    """`launch`'s work that these tensors' signature fixes (o / l may be meta tensors: only their strides are
    read): (the kernel bound to its grid and compile-time arguments, its TMA descriptor templates or None for the
    gather kernel, the numbers after its tensor arguments). `run_stage1` launches it on a call's tensors."""
    B, H, R = q_nope.shape
    PS = ckv_cache.shape[1]
    P = kpe_cache.shape[2]
    sparse = indices is not None
    table = indices if sparse else block_table
    grid = (cdiv(H, BLOCK_H), B, ns)
    scale = sm_scale * G.LOG2E
    strides = G.strides(q_nope, q_pe, ckv_cache, kpe_cache, table, o, l, s_on, s_ln, ns)
    limits = query_limit_args(seq_lens, n_query, H)
    if not G.tma_layout(ckv_cache, kpe_cache, sparse):
        return (bind(_stage1_gather_kernel, grid, **gather_constexprs(R, P, PS, sparse, n_query > 1),
                     num_warps=NUM_WARPS, **G.pdl_launch(q_nope.device)), None,
                (scale, H, table.shape[1] if sparse else 0, *strides, *limits))
    templates = G.descriptor_templates(ckv_cache, kpe_cache)
    return (bind(_stage1_wgmma_kernel, grid, templated_at(2, templates), **constexprs(R, P, PS, n_query > 1),
                 num_warps=NUM_WARPS, **G.pdl_launch(q_nope.device)), templates, (scale, H, *strides, *limits))


def run_stage1(plan, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, o, l, indices=None):
    """A `stage1_plan` (or decode_seesaw's) launched on a call's tensors; returns the compiled kernel."""
    bound, templates, numbers = plan
    if templates is None:  # the gather kernel: the table, then the index list or the lengths
        table = indices if indices is not None else block_table
        return bound(q_nope, q_pe, ckv_cache, kpe_cache, table, table if indices is not None else seq_lens, o, l,
                     *numbers)
    # the caches twice: the descriptors' bases (the bound launch holds their templates), then as pointers
    return bound(q_nope, q_pe, ckv_cache, kpe_cache, ckv_cache, kpe_cache, block_table, seq_lens, o, l, *numbers)


def launch(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns, indices=None,
           n_query: int = 1):
    """Stage 1 into o [ns, B, H, R] / l [ns, B, H] (or the final out / lse with ns == 1: s_on = s_ln = 0); paged
    (block_table, seq_lens) or sparse (indices [B, K], -1 = none). The TMA kernel where the tiles are TMA boxes,
    else the gather kernel. n_query > 1 (paged): H = n_query * heads rows, seq_lens [B] (causal) or [B, n_query]
    (each token's limit), as kernels/decode.py `decode` takes them; a KV tile is read once for all of a block's
    rows, so S tokens of 16 heads cost one 64-row block. One call: its plan made and run (kernels/decode.py
    `AttendPlan` keeps the plan)."""
    plan = stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns,
                       indices, n_query)
    return run_stage1(plan, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, o, l, indices)
