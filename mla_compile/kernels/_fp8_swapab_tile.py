"""The per-tile steps of kernels/decode_fp8_swapab.py's Gluon kernel (its module docstring has the design): the copies
of a tile into a staging slot (TMA boxes, or GATHER: 16-byte cp.async row copies through the table, or TOKENS: either,
as the tile's token-table entries decide, `_fill_slot`),
the e4m3 -> 16-bit conversion into shared memory, the scores' per-row scales, one tile's scores,
softmax and P.V (`_tile`, MASKED for a split's partial last tile), a scale group's store of the output."""

from __future__ import annotations

from . import _gluon as G

if G.gluon is not None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)

if G.gluon is not None:
    @gluon.jit
    def _issue_tile(EDesc, SDesc, RDesc, bar, e_s, sc_s, r_s, st, row, GROUPS: gl.constexpr, GW: gl.constexpr,
                    SC_COL: gl.constexpr, RP_COL: gl.constexpr):
        """TMA copies of the tile at slot row `row` (its 64 tokens in consecutive slots) into staging slot `st`, all
        on `bar`: the e4m3 bytes as [64, 256] boxes (two scale groups each: the widest box; Triton puts a barrier
        before every copy), the [64, 4] float32 scales, the [64, 64] bf16 rope."""
        EB: gl.constexpr = EDesc.block_type.shape[1]
        NB: gl.constexpr = GROUPS * GW // EB  # e4m3 boxes a tile
        mbarrier.expect(bar, NB * EDesc.block_type.nbytes + SDesc.block_type.nbytes + RDesc.block_type.nbytes)
        for k in gl.static_range(NB):
            tma.async_copy_global_to_shared(EDesc, [row, k * EB], bar, e_s.index(st * NB + k))
        tma.async_copy_global_to_shared(SDesc, [row, SC_COL], bar, sc_s.index(st))
        tma.async_copy_global_to_shared(RDesc, [row, RP_COL], bar, r_s.index(st))

    @gluon.constexpr_function
    def _gather_layout(part, NW, GROUPS):
        """The row-copy layout of a tile's `part` (one 16-byte chunk a thread and copy): "e4m3" [64, 256] 16 lanes a
        256-byte row; "scales" [64, 4] float32 one row a lane (the layout covers more rows than the tile: replicas
        copy the same bytes); "rope" [64, 64] bf16 8 lanes a 128-byte row."""
        shapes = {"e4m3": ([1, 16], [2, 16]), "scales": ([1, GROUPS], [32, 1]), "rope": ([1, 8], [4, 8])}
        per_thread, lanes = shapes[part]
        return gl.BlockedLayout(per_thread, lanes, [NW, 1], [1, 0])

    @gluon.jit
    def _gather_pages(Table, b, s_tb, t0, end, BT: gl.constexpr, PS: gl.constexpr, GROUPS: gl.constexpr,
                      TOKENS: gl.constexpr = False):
        """GATHER: the table entries of the tile at t0 in each row-copy layout, loaded a tile before its copies are
        issued: loaded right before them, every tile stalled on the table's latency (H100, H 16 B 8 32K over a
        page-size-1 token table: 164.8 us against 102.7 loaded early; the TMA form on pages of 64: 85.3;
        benchmarks/RESULTS.md 2026-12-05). TOKENS: only the entries in `_gluon.run_layout`, for the check that picks
        the tile's copies (`_fill_slot`): a tile of consecutive rows (a static cache's: nearly every tile) needs no
        other, and a tile that is not loads the row copies' entries when it issues them (a 1-tuple then; holding all
        four copies a tile ahead cost registers and three loads a tile that runs never read)."""
        NW: gl.constexpr = gl.num_warps()
        if TOKENS:  # (a constexpr branch: one return of either type)
            entries = (G.table_entries(Table, b, s_tb, t0, end, BT, PS, G.run_layout(NW)),)
        else:
            EL: gl.constexpr = gl.SliceLayout(1, _gather_layout("e4m3", NW, GROUPS))
            SL: gl.constexpr = gl.SliceLayout(1, _gather_layout("scales", NW, GROUPS))
            RL: gl.constexpr = gl.SliceLayout(1, _gather_layout("rope", NW, GROUPS))
            entries = (G.table_entries(Table, b, s_tb, t0, end, BT, PS, EL),
                       G.table_entries(Table, b, s_tb, t0, end, BT, PS, SL),
                       G.table_entries(Table, b, s_tb, t0, end, BT, PS, RL))
        return entries

    @gluon.jit
    def _rows16(page, t0, end, s_p, s_t, PS: gl.constexpr):
        """The tokens t = t0, t0 + 1, ... whose pages `page` holds (`_gluon.table_entries`, in its layout): (their
        rows' offsets in 16-byte units, int64: page * s_p + (t % PS) * s_t; valid: t < end)."""
        t = t0 + gl.arange(0, page.shape[0], layout=page.type.layout)
        return page.to(gl.int64) * s_p + (t % PS).to(gl.int64) * s_t, t < end

    @gluon.jit
    def _gather_tile(src, bar, e_s, sc_s, r_s, st, pages, t0, end, PS: gl.constexpr, GROUPS: gl.constexpr,
                     GW: gl.constexpr):
        """GATHER: the tile's token rows [t0, t0 + 64) (any page size; `pages`: its table entries, `_gather_pages`)
        into staging slot `st` by 16-byte cp.async copies, each thread's copies then arriving on `bar`
        (cp.async.mbarrier.arrive.noinc: the barrier counts every thread of the program), so `_tile` waits on it as
        on a TMA fill. src: (e4m3 view, float32 scales view, bf16 rope view pointers, then each view's page and token
        strides in 16-byte units). Tokens >= end: their rows zero-filled, nothing read (unused slots may hold NaN
        bytes)."""
        EB: gl.constexpr = e_s.shape[2]
        NB: gl.constexpr = GROUPS * GW // EB  # e4m3 boxes a tile
        P: gl.constexpr = r_s.shape[2]
        NW: gl.constexpr = gl.num_warps()
        EL: gl.constexpr = _gather_layout("e4m3", NW, GROUPS)
        SL: gl.constexpr = _gather_layout("scales", NW, GROUPS)
        RL: gl.constexpr = _gather_layout("rope", NW, GROUPS)
        er, ev = _rows16(pages[0], t0, end, src[3], src[4], PS)
        ec = gl.arange(0, EB, layout=gl.SliceLayout(0, EL))
        for k in gl.static_range(NB):  # (16 e4m3 values, 4 scales, 8 rope values: 16 bytes)
            async_copy.async_copy_global_to_shared(e_s.index(st * NB + k), src[0] + (er * 16 + k * EB)[:, None]
                                                   + ec[None, :], mask=ev[:, None])
        sr, sv = _rows16(pages[1], t0, end, src[5], src[6], PS)
        sg = gl.arange(0, GROUPS, layout=gl.SliceLayout(0, SL))
        async_copy.async_copy_global_to_shared(sc_s.index(st), src[1] + (sr * 4)[:, None] + sg[None, :],
                                               mask=sv[:, None])
        rr, rv = _rows16(pages[2], t0, end, src[7], src[8], PS)
        rc = gl.arange(0, P, layout=gl.SliceLayout(0, RL))
        async_copy.async_copy_global_to_shared(r_s.index(st), src[2] + (rr * 8)[:, None] + rc[None, :],
                                               mask=rv[:, None])
        async_copy.mbarrier_arrive(bar, increment_count=False)

    @gluon.jit
    def _fill_slot(src, bar, e_s, sc_s, r_s, st, Table, b, s_tb, t0, end, PS: gl.constexpr, GROUPS: gl.constexpr,
                   GW: gl.constexpr, SC_COL: gl.constexpr, RP_COL: gl.constexpr, GATHER: gl.constexpr, pages=None,
                   TOKENS: gl.constexpr = False):
        """Tile at token t0 into staging slot `st`, completing on `bar`: TMA (`_issue_tile`; src: the three
        descriptors) or, GATHER, row copies (`_gather_tile`; `pages` its table entries loaded earlier, or None:
        loaded here). TOKENS (GATHER over a token table, src: GATHER's then the three descriptors): the tile's
        entries decide (`_gluon.run_start`): consecutive rows r0, r0 + 1, ... (tokens past the end aside: a
        request's tokens in a static cache) are the TMA form's boxes at row r0, and one thread arrives for the rest
        of the barrier's count (it counts every thread, for the row copies; the expect is one arrival); any other
        tile is row copies."""
        if GATHER:
            if pages is None:
                pages = _gather_pages(Table, b, s_tb, t0, end, e_s.shape[1], PS, GROUPS, TOKENS)
            if TOKENS:
                row0, run = G.run_start(pages[0], t0, end)
                if run:
                    _issue_tile(src[9], src[10], src[11], bar, e_s, sc_s, r_s, st, row0, GROUPS, GW, SC_COL, RP_COL)
                    mbarrier.arrive(bar, count=32 * gl.num_warps() - 1)
                else:  # the row copies' entries, loaded now (`_gather_pages`)
                    _gather_tile(src, bar, e_s, sc_s, r_s, st, _gather_pages(Table, b, s_tb, t0, end, e_s.shape[1], PS,
                                                                             GROUPS), t0, end, PS, GROUPS, GW)
            else:
                _gather_tile(src, bar, e_s, sc_s, r_s, st, pages, t0, end, PS, GROUPS, GW)
        else:  # the tile lies inside one page
            row = gl.load(Table + b * s_tb + t0 // PS) * PS + t0 % PS
            _issue_tile(src[0], src[1], src[2], bar, e_s, sc_s, r_s, st, row, GROUPS, GW, SC_COL, RP_COL)

    @gluon.jit
    def _dequant(e_t, sc_t, g: gl.constexpr, row0, lim, CVT: gl.constexpr, MASKED: gl.constexpr,
                 EXACT: gl.constexpr):
        """Rows [row0, row0 + n) of scale group g in registers (layout CVT), [n, 128]: EXACT, the e4m3 values
        themselves as fp16 (exact: e4m3's values all fit fp16; one cvt.rn.f16x2.e4m3x2 per two, the scale left to
        the products); else bf16(float32(e4m3) * scale_g). e_t: those rows' e4m3 bytes [n, 128]; sc_t: their scales
        [n, GROUPS]. MASKED: rows >= lim are 0 (not scale 0: a NaN byte times 0 is NaN)."""
        if EXACT:
            v = e_t.load(CVT).to(gl.float16)
        else:
            x = e_t.load(CVT).to(gl.float32)
            # column g of the scales as [n, 1] in the same layout (the 16 lanes sharing a row read one address)
            v = (x * sc_t.slice(g, 1, dim=1).load(CVT)).to(gl.bfloat16)
        if MASKED:
            rows = row0 + gl.arange(0, e_t.shape[0], layout=gl.SliceLayout(1, CVT))
            v = gl.where((rows < lim)[:, None], v, 0.0)
        return v

    @gluon.jit
    def _convert_rows(e_t, sc_t, dq_t, g: gl.constexpr, r0: gl.constexpr, r1: gl.constexpr, lim, SLAB: gl.constexpr,
                      CVT: gl.constexpr, MASKED: gl.constexpr, EXACT: gl.constexpr):
        """Rows [r0, r1) of scale group g, staged e4m3 -> the 16-bit tile dq_t, SLAB rows per store. Fewer rows hold
        fewer registers, but Triton puts a barrier before every store into dq_t (it does not tell the row slabs apart,
        nor them from the tile the score MMA in flight reads): 64 rows (a whole group) is one barrier a group."""
        for r in gl.static_range(r0, r1, SLAB):
            dq_t.slice(r, SLAB, dim=0).store(_dequant(e_t.slice(r, SLAB, dim=0), sc_t.slice(r, SLAB, dim=0), g, r, lim,
                                                      CVT, MASKED, EXACT))

    @gluon.jit
    def _convert_group(e_s, st, sc_t, dq_t, g: gl.constexpr, r0: gl.constexpr, lim, SLAB: gl.constexpr,
                       CVT: gl.constexpr, MASKED: gl.constexpr, EXACT: gl.constexpr):
        """Rows [r0, 64) of scale group g of staging slot st into dq_t (`_convert_rows`), then fenced and every warp
        past them: the group's tile is ready for its score MMA."""
        GW: gl.constexpr = dq_t.shape[1]
        GPB: gl.constexpr = e_s.shape[2] // GW  # scale groups per e4m3 box
        NB: gl.constexpr = sc_t.shape[1] // GPB  # e4m3 boxes a tile
        e_t = e_s.index(st * NB + g // GPB).slice((g % GPB) * GW, GW, dim=1)
        _convert_rows(e_t, sc_t, dq_t, g, r0, e_t.shape[0], lim, SLAB, CVT, MASKED, EXACT)
        fence_async_shared()  # the generic-proxy stores, then the async proxy (wgmma) reads them
        gl.thread_barrier()

    @gluon.jit
    def _row_scale(sc_t, g: gl.constexpr, lim, S_L: gl.constexpr, MASKED: gl.constexpr):
        """scale_g of the tile's rows (tokens) as [64, 1] in the scores' layout; MASKED: rows >= lim 0 (their slots
        may hold NaN)."""
        v = sc_t.slice(g, 1, dim=1).load(S_L)
        if MASKED:
            rows = gl.arange(0, v.shape[0], layout=gl.SliceLayout(1, S_L))
            v = gl.where((rows < lim)[:, None], v, 0.0)
        return v

    @gluon.jit
    def _pick(v, g: gl.constexpr):
        """v[g] of a small vector every thread holds whole (a reduction inside each thread)."""
        return gl.max(gl.where(gl.arange(0, v.shape[0], layout=v.type.layout) == g, v, 0.0), 0)

    @gluon.jit
    def _tile(i, start, end, n_tiles, src, bars, e_s, sc_s, r_s, dq_s, q_s, qp_s, p_s, p1_s, p2_s, p3_s,
              Table, b, s_tb,
              scale_log2, uq, m_i, l_i, acc0, acc1, acc2, acc3, top0, top1, top2, top3, PS: gl.constexpr,
              STAGES: gl.constexpr, SC_COL: gl.constexpr, RP_COL: gl.constexpr, PRE: gl.constexpr, SLAB: gl.constexpr,
              P_ROPE: gl.constexpr, EXACT: gl.constexpr, S_L: gl.constexpr, O_L: gl.constexpr, CVT: gl.constexpr,
              MASKED: gl.constexpr, GATHER: gl.constexpr, TOKENS: gl.constexpr = False):
        """Tile i of the split (tokens start + 64 i ...): its scores, the online softmax, its P.V issued (left in
        flight for the next tile). MASKED: the split's partial last tile (rows r >= end - t0 are no tokens of it:
        zeroed / -inf, their scales 0). GATHER: the slots filled by `_gather_tile` (src its pointers and strides;
        else src the three TMA descriptors); TOKENS: by either, tile by tile (`_fill_slot`). PRE: rows of scale
        group 0 converted in registers before waiting for the previous tile's P.V (overlapping them; more rows, more
        registers). P_ROPE: P^T goes into this tile's staging slot once it is dead (EXACT: the four P^T tiles in the
        e4m3 boxes, converted by then; else the one P^T in the rope slot, its scores done; p_s is then that view), so
        the slot is refilled only once this P.V is retired, at the top of the next tile. Returns (m_i, l_i,
        acc0..acc3 in flight, top0..top3).

        EXACT (module docstring): the tile holds the e4m3 values in fp16, q_s q's latent part in fp16 times a power
        of two per head (uq: its inverse times scale_log2, per column), the scales apply to fp32 products:
            S^T = scale_log2 Krope . q_rope^T + (sum_g scale_g[t] (K8_g . q_g^T)[t, h]) uq[h]
        (one accumulator per group), and each group's P.V takes its own P^T tile, P^T[t, h] scale_g[t] / top_g in
        fp16 (top_g: the tile's largest scale_g, so it lies in [0, 1]); acc_g is kept in units of top_g: the
        previous tile's top (top0..top3 in, 1 before the first tile) over this one's joins the softmax's rescale.
        Else the bf16 tile of value x scale, one score accumulator, one P^T.

        Order: group 0's first PRE rows in registers -> wait for everything in flight (the previous P.V) -> rope
        scores issued -> group 0 stored, fenced, its scores issued -> groups 1-3 each converted while the previous
        group's scores run, stored, fenced, issued -> (EXACT: the scales read) -> scores waited -> softmax -> P^T
        stored -> slot refilled -> P.V issued. One wait with nothing left in flight per tile: waiting for one P.V at
        a time (wgmma_wait(4), the later ones still running) made ptxas serialise every wgmma of the kernel (C7514;
        it does not follow groups left in flight across the loop's back edge)."""
        BT: gl.constexpr = e_s.shape[1]
        GROUPS: gl.constexpr = q_s.shape[0]
        N: gl.constexpr = qp_s.shape[0]
        gl.static_assert((PRE % (2 * gl.num_warps()) == 0) & ((BT - PRE) % SLAB == 0), "PRE, SLAB: whole slabs")
        st = i % STAGES
        lim = end - (start + i * BT)  # rows r < lim are tokens of this split (all 64 but on the partial last tile)
        # an opaque 0 (side-effecting asm: not hoisted) added to the 16-bit tile's, q's and P^T's group indices: their
        # ~100 wgmma smem descriptors (64-bit) are otherwise loop-invariant, LLVM hoists them all out of the loop and
        # they hold registers for the whole kernel (N = 16, 4 warps: 255 registers and spills; with it 187, none);
        # per tile they cost a few uniform-datapath adds
        z = gl.inline_asm_elementwise("mov.u32 $0, 0;", "=r,r", [i], dtype=gl.int32, is_pure=False, pack=1)
        sc_t = sc_s.index(st)
        if GATHER:  # the table entries of the tile this call's fill copies, loaded now: their latency is hidden
            # behind the wait and this tile's MMAs (all masked, no load, past the split's end)
            nxt = i - 1 + STAGES if P_ROPE else i + STAGES
            pages = _gather_pages(Table, b, s_tb, start + nxt * BT, end, BT, PS, GROUPS, TOKENS)
        else:
            pages = None
        mbarrier.wait(bars.index(st), (i // STAGES) & 1)
        r_t = r_s.index(st)
        # rope rows past the end may hold NaN: zeroed before an MMA reads the tile (GATHER: the copies zero-filled
        # them; TOKENS: a run's boxes did not)
        if MASKED and (TOKENS or not GATHER):
            RL: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])  # 8 lanes a row
            rows_r = gl.arange(0, BT, layout=gl.SliceLayout(1, RL))
            r_t.store(gl.where((rows_r < lim)[:, None], r_t.load(RL), 0.0))
        if PRE > 0:
            e0 = e_s.index(st * (GROUPS * q_s.shape[2] // e_s.shape[2])).slice(0, q_s.shape[2], dim=1)
            v0 = _dequant(e0.slice(0, PRE, dim=0), sc_t.slice(0, PRE, dim=0), 0, 0, lim, CVT, MASKED, EXACT)
        # the previous tile's P.V done (in every warp: the barrier) before its tiles and p_s are overwritten
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(0, deps=(acc0, acc1, acc2, acc3))
        if MASKED or GATHER:
            # the zeroed rope rows (GATHER: the row copies, generic-proxy writes like them) for the rope MMA: each
            # thread fences after the barrier wait, every thread before any MMA (the barrier)
            fence_async_shared()
        gl.thread_barrier()
        if P_ROPE:  # the previous tile's slot held its P^T until now: it takes tile i - 1 + STAGES
            if (i >= 1) & (i - 1 + STAGES < n_tiles):
                _fill_slot(src, bars.index((i - 1) % STAGES), e_s, sc_s, r_s, (i - 1) % STAGES, Table, b, s_tb,
                           start + (i - 1 + STAGES) * BT, end, PS, GROUPS, q_s.shape[2], SC_COL, RP_COL, GATHER,
                           pages, TOKENS)
        s = warpgroup_mma(r_t, qp_s.permute((1, 0)), gl.zeros([BT, N], gl.float32, layout=S_L), use_acc=False,
                          is_async=True)
        if PRE > 0:
            dq_s.index(z).slice(0, PRE, dim=0).store(v0)
        if EXACT:
            # one accumulator per group: its rows (tokens) take their own scale_g
            # FOLD: S^T of 32 heads or more a warpgroup (16 registers an accumulator): each group's accumulator is
            # waited for (the next group converted meanwhile) and folded into the scores before the next issues, so
            # two live at a time, not five (N = 64 over two warpgroups, beside O^T's 128: spills with five or three)
            FOLD: gl.constexpr = N // (gl.num_warps() // 4) >= 32
            if FOLD:
                a = s  # (group 0 sets it)
                for g in gl.static_range(GROUPS):
                    if g == 0:
                        _convert_group(e_s, st, sc_t, dq_s.index(z), 0, PRE, lim, SLAB, CVT, MASKED, EXACT)
                    else:
                        _convert_group(e_s, st, sc_t, dq_s.index(g + z), g, 0, lim, SLAB, CVT, MASKED, EXACT)
                        s, a = warpgroup_mma_wait(0, deps=(s, a))
                        if g == 1:
                            s = s * scale_log2
                        s = s + (a * _row_scale(sc_t, g - 1, lim, S_L, MASKED)) * uq
                    a = warpgroup_mma(dq_s.index(g + z), q_s.index(g + z).permute((1, 0)),
                                      gl.zeros([BT, N], gl.float32, layout=S_L), use_acc=False, is_async=True)
            else:
                _convert_group(e_s, st, sc_t, dq_s.index(z), 0, PRE, lim, SLAB, CVT, MASKED, EXACT)
                a0 = warpgroup_mma(dq_s.index(z), q_s.index(z).permute((1, 0)),
                                   gl.zeros([BT, N], gl.float32, layout=S_L), use_acc=False, is_async=True)
                _convert_group(e_s, st, sc_t, dq_s.index(1 + z), 1, 0, lim, SLAB, CVT, MASKED, EXACT)
                a1 = warpgroup_mma(dq_s.index(1 + z), q_s.index(1 + z).permute((1, 0)),
                                   gl.zeros([BT, N], gl.float32, layout=S_L), use_acc=False, is_async=True)
                _convert_group(e_s, st, sc_t, dq_s.index(2 + z), 2, 0, lim, SLAB, CVT, MASKED, EXACT)
                a2 = warpgroup_mma(dq_s.index(2 + z), q_s.index(2 + z).permute((1, 0)),
                                   gl.zeros([BT, N], gl.float32, layout=S_L), use_acc=False, is_async=True)
                _convert_group(e_s, st, sc_t, dq_s.index(3 + z), 3, 0, lim, SLAB, CVT, MASKED, EXACT)
                a3 = warpgroup_mma(dq_s.index(3 + z), q_s.index(3 + z).permute((1, 0)),
                                   gl.zeros([BT, N], gl.float32, layout=S_L), use_acc=False, is_async=True)
            # the scales while the scores run: per row of S^T, and each group's largest over the tile (every thread
            # reads all 64 x 4: a reduction inside each warp; rows past the end count 0)
            sg0 = _row_scale(sc_t, 0, lim, S_L, MASKED)
            sg1 = _row_scale(sc_t, 1, lim, S_L, MASKED)
            sg2 = _row_scale(sc_t, 2, lim, S_L, MASKED)
            sg3 = _row_scale(sc_t, 3, lim, S_L, MASKED)
            TL: gl.constexpr = gl.BlockedLayout([BT // 32, GROUPS], [32, 1], [gl.num_warps(), 1], [1, 0])
            sc_all = sc_t.load(TL)
            if MASKED:
                rows_t = gl.arange(0, BT, layout=gl.SliceLayout(1, TL))
                sc_all = gl.where((rows_t < lim)[:, None], sc_all, 0.0)
            tops = gl.max(sc_all, 0)
            # a tile whose group has no positive scale (no token can: the format's scales are positive) keeps the
            # previous unit: its P^T is 0 there anyway
            u0 = gl.where(_pick(tops, 0) > 0, _pick(tops, 0), top0)
            u1 = gl.where(_pick(tops, 1) > 0, _pick(tops, 1), top1)
            u2 = gl.where(_pick(tops, 2) > 0, _pick(tops, 2), top2)
            u3 = gl.where(_pick(tops, 3) > 0, _pick(tops, 3), top3)
            if FOLD:
                s, a = warpgroup_mma_wait(0, deps=(s, a))
                s = s + (a * sg3) * uq
            else:
                s, a0, a1, a2, a3 = warpgroup_mma_wait(0, deps=(s, a0, a1, a2, a3))
                s = s * scale_log2 + (a0 * sg0 + a1 * sg1 + a2 * sg2 + a3 * sg3) * uq
        else:
            for g in gl.static_range(GROUPS):
                if g == 0:
                    _convert_group(e_s, st, sc_t, dq_s.index(g + z), g, PRE, lim, SLAB, CVT, MASKED, EXACT)
                else:
                    _convert_group(e_s, st, sc_t, dq_s.index(g + z), g, 0, lim, SLAB, CVT, MASKED, EXACT)
                s = warpgroup_mma(dq_s.index(g + z), q_s.index(g + z).permute((1, 0)), s, is_async=True)
            s = warpgroup_mma_wait(0, deps=(s,))
            s = s * scale_log2

        # online softmax per head (column), base 2
        if MASKED:
            rows_s = gl.arange(0, BT, layout=gl.SliceLayout(1, S_L))
            s = gl.where((rows_s < lim)[:, None], s, float("-inf"))
        m_new, alpha, p, l_i = G.column_softmax(s, m_i, l_i)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(0, O_L))[None, :]
        if EXACT:
            if P_ROPE:  # this slot's e4m3 boxes: every warp read them (converting) before the last score MMA
                pb = st * (p_s.shape[0] // STAGES)
            else:  # the previous P.V (their reader) was retired by every warp at the top
                pb = 0
            if P_ROPE:
                pt0 = p_s.index(pb + z)
                pt1 = p_s.index(pb + 1 + z)
                pt2 = p_s.index(pb + 2 + z)
                pt3 = p_s.index(pb + 3 + z)
            else:  # four allocations: Triton tells them apart (no barrier between their stores; views of one it does
                # not: three more barriers a tile)
                pt0 = p_s.index(z)
                pt1 = p1_s.index(z)
                pt2 = p2_s.index(z)
                pt3 = p3_s.index(z)
            pt0.store((p * (sg0 * (1.0 / u0))).to(gl.float16))
            pt1.store((p * (sg1 * (1.0 / u1))).to(gl.float16))
            pt2.store((p * (sg2 * (1.0 / u2))).to(gl.float16))
            pt3.store((p * (sg3 * (1.0 / u3))).to(gl.float16))
        else:
            if P_ROPE:
                gl.static_assert(N == r_t.shape[1], "P^T [64, N] in the [64, 64] rope slot")
                p_t = r_t  # every warp waited for the rope scores (the barrier below orders the stores after them all)
                gl.thread_barrier()
            else:
                p_t = p_s  # the previous P.V (its reader) was retired by every warp at the top
            p_t.store(p.to(p_t.dtype))
        fence_async_shared()
        gl.thread_barrier()
        # every warp waited for this tile's scores (the rope MMA read r_s) and converted its e4m3 groups: the slot
        # takes tile i + STAGES
        if not P_ROPE:
            if i + STAGES < n_tiles:
                _fill_slot(src, bars.index(st), e_s, sc_s, r_s, st, Table, b, s_tb, start + (i + STAGES) * BT, end,
                           PS, GROUPS, q_s.shape[2], SC_COL, RP_COL, GATHER, pages, TOKENS)
        if EXACT:  # acc_g in units of this tile's top_g: times alpha and (previous top) / (this top)
            acc0 = warpgroup_mma(dq_s.index(0 + z).permute((1, 0)), pt0, acc0 * (alpha_o * (top0 / u0)), is_async=True)
            acc1 = warpgroup_mma(dq_s.index(1 + z).permute((1, 0)), pt1, acc1 * (alpha_o * (top1 / u1)), is_async=True)
            acc2 = warpgroup_mma(dq_s.index(2 + z).permute((1, 0)), pt2, acc2 * (alpha_o * (top2 / u2)), is_async=True)
            acc3 = warpgroup_mma(dq_s.index(3 + z).permute((1, 0)), pt3, acc3 * (alpha_o * (top3 / u3)), is_async=True)
            top0, top1, top2, top3 = u0, u1, u2, u3
        else:
            acc0 = warpgroup_mma(dq_s.index(0 + z).permute((1, 0)), p_t, acc0 * alpha_o, is_async=True)
            acc1 = warpgroup_mma(dq_s.index(1 + z).permute((1, 0)), p_t, acc1 * alpha_o, is_async=True)
            acc2 = warpgroup_mma(dq_s.index(2 + z).permute((1, 0)), p_t, acc2 * alpha_o, is_async=True)
            acc3 = warpgroup_mma(dq_s.index(3 + z).permute((1, 0)), p_t, acc3 * alpha_o, is_async=True)
        return m_new, l_i, acc0, acc1, acc2, acc3, top0, top1, top2, top3

    @gluon.jit
    def _store_group(O, acc, inv, o_base, oh, H, g: gl.constexpr, GW: gl.constexpr, O_L: gl.constexpr):
        """out[h, g * 128 + c] = acc[c, h] * inv[h] for this program's heads h < H (acc is O^T's group g; o_base
        [1, N]: the heads' row offsets in O)."""
        oc = gl.arange(0, GW, layout=gl.SliceLayout(1, O_L))
        ptr = O + o_base + g * GW + oc[:, None]
        gl.store(ptr, acc * inv[None, :], mask=(oh < H)[None, :] & (oc < GW)[:, None])

