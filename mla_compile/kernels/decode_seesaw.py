"""Many-head paged MLA decode, stage 1, warp-specialised: two warpgroups take turns ("seesaw") over pairs of tiles.

Why (decode_wgmma.py's phase probe): with both warpgroups sharing every tile, each re-reads q from shared
memory for its half of the tile's scores - 216 KB of shared-memory traffic per 64 tokens for the score MMA alone,
and the kernel is bound by that serial chain (q.ckv^T ~310 of 677 us at B=8 128K). Here each warpgroup scores a
WHOLE tile (n = 64, q read once per tile), and the two work on alternating tiles A (slot 0) and B (slot 1):

  WG0: s_A = q.A^T -> m_A, p_A (p_A into slot 0's dead rope buffer, m_A to WG1) -> acc0 += p_A.c0_A (p_A from
       registers) -> [m_B, p_B from WG1] acc0 rescale -> acc0 += p_B.c0_B
  WG1: s_B = q.B^T -> [m_A, p_A from WG0] acc1 rescale, acc1 += p_A.c1_A -> m_B, p_B (into slot 1's rope buffer,
       m_B to WG0) -> acc1 rescale -> acc1 += p_B.c1_B

Each warpgroup owns one latent half of the output (acc0 = c0 columns, acc1 = c1 columns: an m64n256 MMA), so every
product is computed once, and one warpgroup's softmax overlaps the other's MMAs. A one-warp partition issues the
TMA loads, each tile in three parts (rope, c0, c1) with a barrier each: the score MMA starts on the parts that have
arrived, and each part refills as soon as its last reader released it (see `empty` in the kernel). Row sums stay
per warpgroup (each applies every rescale) and meet once at the end. A split's partial last tile: rows past seq_len
are zeroed in shared memory by the warpgroup that scores the tile before any MMA reads them (cache slots past
seq_len may hold NaN); a lone last tile pairs with a box of zeros.

Pages of whole 64-token tiles (TMA boxes), rope width 64 (p reuses the rope buffer); other layouts use
decode_wgmma's kernels. Several query tokens per request fold into the rows as there (MULTI: a causal limit per
row). Same outputs as them: normalised partial out and natural-log lse per split.

Measured (H200, benchmarks/RESULTS.md, the seesaw kernel): 1-6% faster than decode_wgmma's TMA kernel on every
shape (B=8 128K stage 1 669 vs 708 us, 429 TFLOP/s). What bounds it: the copies. Timing probes with the loader's
copies skipped ran stage 1 at 554-577 TFLOP/s (B >= 8), so the MMA schedule is fine; shared memory holds only q
and one pair of tiles, slot B frees when the pair's last MMAs finish and is needed again by the next pair's first
scores, so every pair waits for one tile's copy (~23-26%). The schedules and prefetches tried against that, each
slower, are listed in benchmarks/lab/README.md. A full double buffer in the same bytes (32-token tiles in two sets of
slots, `TILE_N` / `SLOT_SETS` below) won 8% at two shapes and lost 2-4% at two others: the copy wait is not the
whole gap to FlashMLA.
"""

from __future__ import annotations


from . import _gluon as G
from ._util import cdiv, query_limit_args
from ._launch import bind, templated_at
from .decode_wgmma import run_stage1

if G.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

BLOCK_H = G.BLOCK_H
# tokens per tile and sets of (A, B) slots: 2 x SLOT_SETS tiles of TILE_N tokens share the shared memory the tile slots
# have (q takes the rest). 64 x 1: the pair's slot B is needed again by the next pair's first scores as soon as it
# frees; 32 x 2: the next pair loads into the other set while this one computes, for twice the softmax and barrier
# steps per token. Measured side by side (H100, H 128, graph replay; benchmarks/RESULTS.md 2026-12-07, sixteenth
# session): 32 x 2 is 8% faster at B 32 32K and B 8 8K, 2-4% slower at B 8 32K and B 32 8K, even elsewhere, with no
# rule in the shapes that tells them apart: 64 x 1 stays. Both builds are tested (tests/kernels/test_kernel_codegen.py;
# the GPU tests ran at 32 x 2 through benchmarks/lab/seesaw_tiling_plugin.py)
TILE_N = 64
SLOT_SETS = 1
NUM_WARPS = 4  # the default partition (warpgroup 0); + a 4-warp worker (warpgroup 1) + a 1-warp loader
# 3 warpgroups at launch share the register file (65536 / 384 threads); then the loader gives back all but 24
MAX_REGS = 168
# warpgroup 1's; warpgroup 0 gets the rest (168 * 3 - 240 - 24 = 240)
WG_REGS = gl.constexpr(240) if G.gluon is not None else 240
LOADER_REGS = gl.constexpr(24) if G.gluon is not None else 24
SPILL_BUDGET = 512  # bytes ptxas may spill (offline count, tests/kernels/test_kernel_codegen.py): a few scalars outside MMAs


def smem_bytes(R: int, P: int, itemsize: int = 2) -> int:
    """q + the tile slots (p lives in the slots' rope buffers) + barriers and the m / l exchange."""
    return itemsize * (BLOCK_H * (R + P) + 2 * SLOT_SETS * TILE_N * (R + P)) + 4 * 4 * BLOCK_H + 128 * SLOT_SETS


def _has_warp_specialize() -> bool:
    """Gluon's `warp_specialize([(fn, args), ...], worker_num_warps, worker_num_regs)` (Triton 3.6's form; 3.5 took
    the default and worker partitions as separate arguments): without it decode_wgmma's TMA kernel serves."""
    import inspect

    fn = getattr(gl, "warp_specialize", None) if G.gluon is not None else None
    return fn is not None and "functions_and_args" in inspect.signature(fn).parameters


HAS_WARP_SPECIALIZE = _has_warp_specialize()


def fits(R: int, P: int) -> bool:
    """The shapes this kernel takes (on decode_wgmma's TMA layout, `_gluon.tma_layout`): p [64 heads, TILE_N
    tokens] fits a tile's rope buffer [TILE_N tokens, P] (P == 64), two latent halves, shared memory, and a Gluon with
    this warp_specialize."""
    return HAS_WARP_SPECIALIZE and P == BLOCK_H and R % 2 == 0 and smem_bytes(R, P) <= G.SMEM_LIMIT


if G.gluon is not None:

    @gluon.jit
    def _zero_rows_past(buf, t0, end, LD: gl.constexpr):
        """Rows t0 + i >= end of a [BLOCK_N, width] tile in shared memory set to 0 (generic-proxy stores: fence and
        sync before an MMA reads them)."""
        n: gl.constexpr = buf.shape[0]
        rows = t0 + gl.arange(0, n, layout=gl.SliceLayout(1, LD))
        v = buf.load(LD)
        buf.store(gl.where((rows < end)[:, None], v, gl.zeros_like(v)))

    @gluon.jit
    def _softmax_tile(s, t0, end, limit, m_prev, scale_log2, S_L: gl.constexpr, MULTI: gl.constexpr):
        """Scores of tokens [t0, t0 + BLOCK_N) (those >= end masked; MULTI: also those >= the row's own limit)
        against the running max m_prev: (m_new, alpha = the rescale of what was accumulated under m_prev, p = exp2
        of the scores under m_new, unnormalised)."""
        n: gl.constexpr = s.shape[1]
        t = t0 + gl.arange(0, n, layout=gl.SliceLayout(0, S_L))
        mask = (t < end)[None, :]
        if MULTI:
            mask = mask & (t[None, :] < limit[:, None])
        s = gl.where(mask, s * scale_log2, float("-inf"))
        m_new = gl.maximum(m_prev, gl.max(s, 1))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no token stay NaN-free
        return m_new, gl.exp2(m_prev - m_use), gl.exp2(s - m_use[:, None])

    @gluon.jit
    def _rescale(m_from, m_to):
        """exp2(m_from - m_to), 0 while m_to is still -inf."""
        return gl.exp2(m_from - gl.where(m_to == float("-inf"), 0.0, m_to))

    @gluon.jit
    def _load_part(CkvDesc, KpeDesc, c0_s, c1_s, k_s, full, empty, row, free, ST, PART: gl.constexpr,
                   RH: gl.constexpr):
        """Part PART (0 rope, 1 c0, 2 c1) of the tile at cache row `row` into slot ST, once its last reader released
        the slot's previous one (empty, parity `free`)."""
        i = 3 * ST + PART
        mbarrier.wait(empty.index(i), free)
        if PART == 0:
            mbarrier.expect(full.index(i), KpeDesc.block_type.nbytes)
            tma.async_copy_global_to_shared(KpeDesc, [row, 0], full.index(i), k_s.index(ST))
        elif PART == 1:
            mbarrier.expect(full.index(i), CkvDesc.block_type.nbytes)
            tma.async_copy_global_to_shared(CkvDesc, [row, 0], full.index(i), c0_s.index(ST))
        else:
            mbarrier.expect(full.index(i), CkvDesc.block_type.nbytes)
            tma.async_copy_global_to_shared(CkvDesc, [row, RH], full.index(i), c1_s.index(ST))

    @gluon.jit
    def _seesaw_loader(CkvDesc, KpeDesc, Table, c0_s, c1_s, k_s, full, empty, b, s_tb, start, n_tiles,
                       PS: gl.constexpr, RH: gl.constexpr, NSETS: gl.constexpr):
        """Pair j's tiles A (slot 2 (j % NSETS)) and B (the slot after it), part by part (rope first: the score MMA
        starts on it, then c0, c1), each once its last reader released it (with two sets, pair j + 1 loads while pair
        j computes). A lone last tile A gets a B of zeros (a box wholly outside the cache: TMA fills it with zeros),
        which the warpgroups mask like any token past the split's end."""
        BLOCK_N: gl.constexpr = c0_s.shape[1]
        for j in range(gl.cdiv(n_tiles, 2)):
            sa = (j % NSETS) * 2
            free = ((j // NSETS) & 1) ^ 1  # a fresh barrier passes parity 1 at once
            t_a = start + 2 * j * BLOCK_N
            row_a = gl.load(Table + b * s_tb + t_a // PS) * PS + t_a % PS
            row_b = -BLOCK_N
            if 2 * j + 1 < n_tiles:
                t_b = t_a + BLOCK_N
                row_b = gl.load(Table + b * s_tb + t_b // PS) * PS + t_b % PS
            for part in gl.static_range(3):
                _load_part(CkvDesc, KpeDesc, c0_s, c1_s, k_s, full, empty, row_a, free, sa, part, RH)
            for part in gl.static_range(3):
                _load_part(CkvDesc, KpeDesc, c0_s, c1_s, k_s, full, empty, row_b, free, sa + 1, part, RH)

    @gluon.jit
    def _p_view(k_s, st, BLOCK_H: gl.constexpr, P_SL: gl.constexpr):
        """Slot st's rope buffer [TILE_N tokens, P] as p [BLOCK_H heads, TILE_N tokens]: the same bytes (P == BLOCK_H),
        written once the tile's scores are done."""
        BN: gl.constexpr = k_s.shape[1]
        if BN == k_s.shape[2]:
            v = k_s.index(st)
        else:
            v = k_s.index(st)._reinterpret(k_s.dtype, [BLOCK_H, BN], P_SL)
        return v

    @gluon.jit
    def _seesaw_warpgroup(WG: gl.constexpr, q0_s, q1_s, qp_s, c0_s, c1_s, k_s, full, empty, p_ready, m_x, l_x,
                          l_ready, O, L, b, hb, split, H, start, end, n_tiles, scale_log2,
                          s_on, s_ob, s_oh, s_ln, s_lb, s_lh, Lens, n_query, heads_per_query, s_lenb, s_lenq,
                          causal, RH: gl.constexpr, MULTI: gl.constexpr, NSETS: gl.constexpr):
        """Warpgroup WG's side of the seesaw (module docstring): it scores each pair's tile WG (slot 2 (j % NSETS)
        + WG) and owns output columns [WG * RH, (WG + 1) * RH). p_ready[w] / m_x[w]: warpgroup w's p and running
        max of this pair of tiles are in shared memory (p in its tile's rope buffer). MULTI: several query tokens
        per request in the rows, each row masked at its own limit (`_gluon.row_limits`)."""
        gl.static_assert(gl.num_warps() == 4, "one warpgroup")
        BLOCK_H: gl.constexpr = q0_s.shape[0]
        BLOCK_N: gl.constexpr = c0_s.shape[1]
        S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BLOCK_N, 16])
        O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, RH, 16])
        P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
        P_SL: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, BLOCK_N], c0_s.dtype)
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        ROW: gl.constexpr = gl.SliceLayout(1, S_L)
        OTHER: gl.constexpr = 1 - WG
        if WG == 0:
            c_own = c0_s
        else:
            c_own = c1_s
        dt: gl.constexpr = c0_s.dtype

        if MULTI:
            limit = G.row_limits(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal, ROW, BLOCK_H)
        else:
            limit = end  # unread
        m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, layout=ROW)
        l_i = gl.zeros([BLOCK_H], gl.float32, layout=ROW)
        acc = gl.zeros([BLOCK_H, RH], gl.float32, layout=O_L)
        s0 = gl.zeros([BLOCK_H, BLOCK_N], gl.float32, layout=S_L)
        for j in range(gl.cdiv(n_tiles, 2)):  # a lone last tile A pairs with an all-zero B (see the loader)
            ph = (j // NSETS) & 1  # the slots' fills (each set takes every NSETS-th pair)
            sa = (j % NSETS) * 2
            sb = sa + 1
            so = sa + WG  # this warpgroup's tile of the pair
            t_own = start + (2 * j + WG) * BLOCK_N
            partial = (t_own < end) & (t_own + BLOCK_N > end)  # the split's partial last tile
            if partial:  # all its parts, then zero the rows past seq_len
                for part in gl.static_range(3):
                    mbarrier.wait(full.index(3 * so + part), ph)
            if partial:
                _zero_rows_past(c0_s.index(so), t_own, end, LD)
                _zero_rows_past(c1_s.index(so), t_own, end, LD)
                _zero_rows_past(k_s.index(so), t_own, end, LD)
                fence_async_shared()
                gl.thread_barrier()
            # the score MMA starts on the parts that have arrived (each its own barrier; waiting for the whole tile
            # was slower, benchmarks/RESULTS.md); these return at once where waited above
            mbarrier.wait(full.index(3 * so), ph)
            s = warpgroup_mma(qp_s, k_s.index(so).permute((1, 0)), s0, use_acc=False, is_async=True)
            mbarrier.wait(full.index(3 * so + 1), ph)
            s = warpgroup_mma(q0_s, c0_s.index(so).permute((1, 0)), s, is_async=True)
            mbarrier.wait(full.index(3 * so + 2), ph)
            s = warpgroup_mma(q1_s, c1_s.index(so).permute((1, 0)), s, is_async=True)
            if WG == 0:
                s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
                m_a, alpha, p = _softmax_tile(s, t_own, end, limit, m_i, scale_log2, S_L, MULTI)
                _p_view(k_s, sa, BLOCK_H, P_SL).store(p.to(dt))  # tile A's rope part is dead once its scores are done
                m_x.index(0).store(m_a)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_ready.index(0))
                l_i = l_i * alpha + gl.sum(p, 1)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dt), P_L), c_own.index(sa), acc, is_async=True)
                mbarrier.wait(p_ready.index(1), j & 1)
                m_b = m_x.index(1).load(ROW)
                alpha = _rescale(m_a, m_b)
                l_i = l_i * alpha
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(3 * sa + 1))  # c0_A read for the last time
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                # p_B from shared memory
                acc = warpgroup_mma(_p_view(k_s, sb, BLOCK_H, P_SL), c_own.index(sb), acc, is_async=True)
            else:
                mbarrier.wait(p_ready.index(0), j & 1)
                m_a = m_x.index(0).load(ROW)
                alpha = _rescale(m_i, m_a)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
                # p_A from shared memory
                acc = warpgroup_mma(_p_view(k_s, sa, BLOCK_H, P_SL), c_own.index(sa), acc, is_async=True)
                # the softmax of tile B runs while p_A.c1_A is on the tensor cores
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s,))
                m_b, alpha_b, p = _softmax_tile(s, t_own, end, limit, m_a, scale_log2, S_L, MULTI)
                _p_view(k_s, sb, BLOCK_H, P_SL).store(p.to(dt))
                m_x.index(1).store(m_b)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(p_ready.index(1))
                l_i = l_i * alpha * alpha_b + gl.sum(p, 1)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
                mbarrier.arrive(empty.index(3 * sa))  # rope_A (p_A) and c1_A read for the last time
                mbarrier.arrive(empty.index(3 * sa + 2))
                acc = acc * gl.convert_layout(alpha_b, gl.SliceLayout(1, O_L))[:, None]
                acc = warpgroup_mma(gl.convert_layout(p.to(dt), P_L), c_own.index(sb), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
            if WG == 0:  # rope_B (p_B) and c0_B read for the last time
                mbarrier.arrive(empty.index(3 * sb))
                mbarrier.arrive(empty.index(3 * sb + 1))
            else:  # c1_B
                mbarrier.arrive(empty.index(3 * sb + 2))
            m_i = m_b

        # the row sums meet: each warpgroup applied every rescale, so l = l0 + l1 under the common final max
        l_x.index(WG).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(l_ready)
        mbarrier.wait(l_ready, 0)
        l_i = l_i + l_x.index(OTHER).load(ROW)
        has = l_i > 0
        inv = gl.convert_layout(1.0 / gl.where(has, l_i, 1.0), gl.SliceLayout(1, O_L))[:, None]
        oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, O_L))
        orr = gl.arange(0, RH, layout=gl.SliceLayout(0, O_L))
        o_ptr = O + split.to(gl.int64) * s_on + b * s_ob + oh[:, None] * s_oh + WG * RH + orr[None, :]
        gl.store(o_ptr, acc * inv, mask=(oh < H)[:, None] & (orr < RH)[None, :])
        if WG == 0:
            lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
            lh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=ROW)
            gl.store(L + split * s_ln + b * s_lb + lh * s_lh, lse, mask=lh < H)

    @gluon.jit
    def _stage1_seesaw_kernel(Qn, Qp, CkvDesc, KpeDesc, Ckv, Kpe, Table, Lens, O, L,
                              scale_log2, H,
                              s_qnb, s_qnh, s_qpb, s_qph, s_cp, s_cs, s_kp, s_ks, s_tb,
                              s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                              n_splits, n_query, heads_per_query, s_lenb, s_lenq, causal,
                              PS: gl.constexpr, RH: gl.constexpr, P: gl.constexpr,
                              BLOCK_H: gl.constexpr, BLOCK_N: gl.constexpr, MULTI: gl.constexpr = False,
                              NSETS: gl.constexpr = 1):
        gl.static_assert(P == BLOCK_H, "p [heads, tokens] reuses the [tokens, rope] buffer")
        LD: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        dt: gl.constexpr = CkvDesc.dtype
        hb = gl.program_id(0)
        b = gl.program_id(1).to(gl.int64)
        split = gl.program_id(2)
        if MULTI:  # the block's token range runs to its last row's limit; each row masks the rest
            n = G.block_token_end(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal, BLOCK_H)
        else:
            n = gl.load(Lens + b)
        start, end, _ = G.split_bounds(n, split, n_splits, BLOCK_N)
        n_tiles = gl.cdiv(gl.maximum(end - start, 0), BLOCK_N)
        q0_s, q1_s, qp_s = G.q_to_smem(Qn, Qp, b, hb, H, s_qnb, s_qnh, s_qpb, s_qph, dt, RH, P, BLOCK_H, LD)
        c0_s = gl.allocate_shared_memory(dt, [2 * NSETS, BLOCK_N, RH], CkvDesc.layout)
        c1_s = gl.allocate_shared_memory(dt, [2 * NSETS, BLOCK_N, RH], CkvDesc.layout)
        k_s = gl.allocate_shared_memory(dt, [2 * NSETS, BLOCK_N, P], KpeDesc.layout)
        VEC_SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        m_x = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SL)
        l_x = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], VEC_SL)
        # slot x (rope, c0, c1)
        full = gl.allocate_shared_memory(gl.int64, [2 * NSETS * 3, 1], mbarrier.MBarrierLayout())
        # slot x (rope, c0, c1), like full; each part's last reader releases it: c0_A WG0 after p_A.c0_A, rope_A (p_A)
        # and c1_A WG1 after p_A.c1_A, rope_B (p_B) and c0_B WG0 after p_B.c0_B, c1_B WG1 after p_B.c1_B
        empty = gl.allocate_shared_memory(gl.int64, [2 * NSETS * 3, 1], mbarrier.MBarrierLayout())
        p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        l_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2 * NSETS * 3):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(p_ready.index(i), count=1)
        mbarrier.init(l_ready, count=2)
        fence_async_shared()  # q's stores and the barrier inits before any async-proxy access
        gl.thread_barrier()

        gl.warp_specialize([
            (_seesaw_warpgroup, (0, q0_s, q1_s, qp_s, c0_s, c1_s, k_s, full, empty, p_ready, m_x, l_x, l_ready, O, L,
                                 b, hb, split, H, start, end, n_tiles, scale_log2, s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                                 Lens, n_query, heads_per_query, s_lenb, s_lenq, causal, RH, MULTI, NSETS)),
            (_seesaw_warpgroup, (1, q0_s, q1_s, qp_s, c0_s, c1_s, k_s, full, empty, p_ready, m_x, l_x, l_ready, O, L,
                                 b, hb, split, H, start, end, n_tiles, scale_log2, s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                                 Lens, n_query, heads_per_query, s_lenb, s_lenq, causal, RH, MULTI, NSETS)),
            (_seesaw_loader, (CkvDesc, KpeDesc, Table, c0_s, c1_s, k_s, full, empty, b, s_tb, start, n_tiles, PS,
                              RH, NSETS)),
        ], [4, 1], [WG_REGS, LOADER_REGS])


def constexprs(R: int, P: int, page_size: int, multi: bool = False) -> dict:
    """The kernel's compile-time arguments (shared with tools/aot.py's codegen check)."""
    return dict(PS=page_size, RH=R // 2, P=P, BLOCK_H=BLOCK_H, BLOCK_N=TILE_N, MULTI=multi, NSETS=SLOT_SETS)


def stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns,
                n_query: int = 1):
    """decode_wgmma.stage1_plan's contract for this kernel (TMA layout only): run it with decode_wgmma.run_stage1."""
    B, H, R = q_nope.shape
    PS = ckv_cache.shape[1]
    P = kpe_cache.shape[2]
    templates = G.descriptor_templates(ckv_cache, kpe_cache, TILE_N)
    bound = bind(_stage1_seesaw_kernel, (cdiv(H, BLOCK_H), B, ns), templated_at(2, templates),
                 **constexprs(R, P, PS, n_query > 1), num_warps=NUM_WARPS, maxnreg=MAX_REGS)
    numbers = (sm_scale * G.LOG2E, H, *G.strides(q_nope, q_pe, ckv_cache, kpe_cache, block_table, o, l, s_on, s_ln, ns),
               *query_limit_args(seq_lens, n_query, H))
    return bound, templates, numbers


def launch(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns,
           n_query: int = 1):
    """decode_wgmma.launch's contract (n_query included), for its TMA layout with rope width 64 (`fits`)."""
    plan = stage1_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns,
                       n_query)
    return run_stage1(plan, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, o, l)
