"""What the Gluon stage-1 kernels share (the many-head decode_wgmma.py, decode_seesaw.py; the swap-AB
decode_swapab.py, decode_fp8_swapab.py): the Gluon import, tile sizes, shared-memory limit, split bounds, q into
shared memory, TMA descriptors, the swap-AB kernels' program decode and per-column online softmax.

Every one computes the same thing as the Triton stage 1 (decode.py): per (request, block of heads, KV split) the
normalised partial out and natural-log lse, so decode.py's merge serves all of them. Which one runs is
decided in one place: `dispatch.select_decode_kernel`.
"""

from __future__ import annotations

import functools
import os

import torch

from ._launch import without_bases
from ._util import caches_view_as_slots, slot_stride, pdl_launch as _util_pdl_launch
from ..tuning import GLUON_PDL_ENV

try:  # Gluon ships with Triton >= 3.5; without it the Triton kernels serve every shape
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover - depends on the Triton build
    gluon = None

# Programmatic dependent launch for the Gluon kernels, as for the Triton ones (_util.pdl_launch): in a CUDA graph a
# kernel's launch overlaps the tail of the one before it. The HF step (H 16, B 8, 32K, bf16; H100, the swap-AB
# TOKENS form) took 793.7 vs 817.3 us with it (benchmarks/RESULTS.md 2026-12-06, twelfth session).
# `MLA_COMPILE_GLUON_PDL=0` (or `MLA_COMPILE_PDL=0`, every kernel's) turns it off. Read when a plan is made
# (ops/_plans.py keys plans by it). Not for warp-specialised kernels (decode_seesaw.py): griddepcontrol.wait holds
# only the thread that runs it, and their worker partitions start past the kernel's first statement.


def pdl_launch(device) -> dict:
    """A Gluon kernel's launch arguments for PDL (its PDL constexpr and the launch attribute), {} where it is off."""
    return _util_pdl_launch(device) if os.environ.get(GLUON_PDL_ENV, "auto") in ("auto", "1") else {}


BLOCK_H = 64  # one warpgroup MMA's M: heads per program
BLOCK_N = 64  # tokens per tile
SMEM_LIMIT = 227 * 1024  # Hopper's largest per-block shared memory
LOG2E = 1.4426950408889634


def tma_layout(ckv_cache, kpe_cache, sparse: bool) -> bool:
    """Tiles are TMA boxes: a paged (not sparse) cache with pages of whole 64-token tiles that views as
    [slots, width], 16-byte aligned."""
    return not sparse and ckv_cache.shape[1] % BLOCK_N == 0 and caches_view_as_slots(ckv_cache, kpe_cache)


def token_rows(ckv_cache, kpe_cache, sparse: bool) -> bool:
    """A page-size-1 cache under a token table (each entry a token's row: the HF pass's tables) that views as
    [slots, width], 16-byte aligned: the swap-AB kernel's TOKENS form takes a tile of consecutive rows as TMA boxes."""
    return not sparse and ckv_cache.shape[1] == 1 and caches_view_as_slots(ckv_cache, kpe_cache)


def rows_aligned(ckv_cache, kpe_cache) -> bool:
    """Every cache row starts 16 bytes aligned with unit inner stride: what 16-byte async copies per row need."""
    return all(t.stride(-1) == 1 and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0 and t.data_ptr() % 16 == 0
               for t in (ckv_cache, kpe_cache))


def _gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.lru_cache(maxsize=64)
def _box_layouts(R: int, P: int, dtype: torch.dtype, block_n: int = BLOCK_N):
    # per call on the host otherwise: get_default_for costs ~11 us a layout on one CPU core
    gdt = _gl_dtype(dtype)
    return (gl.NVMMASharedLayout.get_default_for([block_n, R // 2], gdt),
            gl.NVMMASharedLayout.get_default_for([block_n, P], gdt))


def descriptors(ckv_cache, kpe_cache, block_n: int = BLOCK_N):
    """TMA descriptors over the whole caches seen as [slots, width] (`caches_view_as_slots`: rows `slot_stride`
    apart, e.g. two column ranges of one buffer): boxes of one tile (block_n tokens) of one latent half, and of the
    rope part."""
    NP, PS, R = ckv_cache.shape
    P = kpe_cache.shape[2]
    c_layout, k_layout = _box_layouts(R, P, ckv_cache.dtype, block_n)
    return (TensorDescriptor(ckv_cache, [NP * PS, R], [slot_stride(ckv_cache), 1], [block_n, R // 2], c_layout),
            TensorDescriptor(kpe_cache, [NP * PS, P], [slot_stride(kpe_cache), 1], [block_n, P], k_layout))


def descriptor_templates(ckv_cache, kpe_cache, block_n: int = BLOCK_N) -> tuple:
    """`descriptors` as a plan keeps them (no tensor held): a bound launch holds them (`_launch.bind(...,
    templated_at(2, templates))`) and a call passes its caches as their bases (only their pointers are read)."""
    return without_bases(descriptors(ckv_cache, kpe_cache, block_n))


def strides(q_nope, q_pe, ckv_cache, kpe_cache, table, o, l, s_on, s_ln, ns) -> tuple:
    """The stride arguments every Gluon stage-1 kernel takes, in their order."""
    return (q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1), ckv_cache.stride(0),
            ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1), table.stride(0),
            s_on, o.stride(-3), o.stride(-2), s_ln, l.stride(-2), l.stride(-1), ns)


if gluon is not None:

    @gluon.jit
    def pdl_enter(PDL: gl.constexpr):
        """First statement of a Gluon kernel launched with `pdl_launch` (what _util.pdl_enter is for the Triton
        kernels): every thread waits until the previous kernel on the stream has completed and its writes are
        visible, before any memory access, then lets the next kernel launch. Nothing while PDL is off."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def load_rows(base, rows, offs_c, valid, WIDTH: gl.constexpr):
        """[len(rows), WIDTH] from base + rows[:, None] + offs_c[None, :], zero where not valid."""
        return gl.load(base + rows[:, None] + offs_c[None, :], mask=valid[:, None] & (offs_c[None, :] < WIDTH),
                       other=0.0)

    @gluon.jit
    def table_entries(Table, b, s_tb, t0, end, BT: gl.constexpr, PS: gl.constexpr, layout: gl.constexpr):
        """The table entries of tokens [t0, t0 + BT) of request b in `layout` (int32, table[b, t // PS]: pages, or
        with PS 1 a token table's rows); tokens past the end read no entry (it may be garbage): 0."""
        t = t0 + gl.arange(0, BT, layout=layout)
        return gl.load(Table + b * s_tb + t // PS, mask=t < end, other=0)

    @gluon.constexpr_function
    def run_layout(num_warps):
        """A swap-AB tile's 64 token-table entries with every warp holding all of them (2 a lane): `run_start`'s
        reductions then stay inside a warp (no shared memory, no barrier)."""
        return gl.SliceLayout(1, gl.BlockedLayout([2, 1], [32, 1], [1, num_warps], [0, 1]))

    @gluon.jit
    def run_start(rows, t0, end):
        """The swap-AB kernels' TOKENS check of a tile of a token table: (row0, whether every token t0 + i < end sits
        at row row0 + i): the tile is then one TMA box at row row0 (any row: a box needs no tile alignment). `rows`:
        its entries in `run_layout` (entries past the end are ignored)."""
        i = gl.arange(0, rows.shape[0], layout=rows.type.layout)
        valid = t0 + i < end
        d = rows - i
        lo = gl.min(gl.where(valid, d, 2147483647), 0)
        hi = gl.max(gl.where(valid, d, -2147483647), 0)
        return lo, lo == hi

    @gluon.jit
    def swapab_program(Lens, H, n_splits, pid, split, N: gl.constexpr, BT: gl.constexpr):
        """A swap-AB kernel's program (pid, split) of grid (B * ceil(H / N), n_splits), request-major: a request's
        head blocks are neighbours, sharing its tiles in L2): (b int64, head block, split, its tokens [start, end),
        whole tiles, tiles)."""
        n_hb = gl.cdiv(H, N)
        b = (pid // n_hb).to(gl.int64)
        start, end, n_full = split_bounds(gl.load(Lens + b), split, n_splits, BT)
        return b, pid % n_hb, split, start, end, n_full, gl.cdiv(gl.maximum(end - start, 0), BT)

    @gluon.jit
    def merge_row_block(O, L, Out, Lse, bh, rb, N, H, R,
                        s_on, s_ob, s_oh, s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb, s_lseh,
                        BLOCK_N: gl.constexpr, BLOCK_R: gl.constexpr, ONE_PASS: gl.constexpr):
        """kernels/merge.py's `merge_row_block` in Gluon, the same arithmetic in the same order (a Gluon stage-1
        kernel's merge programs: "a split launch that merges itself" there)."""
        LM: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [1, gl.num_warps()], [1, 0])
        b = (bh // H).to(gl.int64)
        h = (bh % H).to(gl.int64)
        offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LM))
        offs_r = rb * BLOCK_R + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, LM))
        mask_r = offs_r < R
        l_base = L + b * s_lb + h * s_lh
        o_base = O + b * s_ob + h * s_oh
        if ONE_PASS:
            lse = gl.load(l_base + offs_n * s_ln, mask=offs_n < N, other=float("-inf"))
            o = gl.load(o_base + offs_n[:, None].to(gl.int64) * s_on + offs_r[None, :],
                        mask=(offs_n < N)[:, None] & mask_r[None, :], other=0.0)
            ok = gl.abs(lse) < float("inf")
            m = gl.max(gl.where(ok, lse, float("-inf")), 0)
            m = gl.where(m == float("-inf"), 0.0, m)
            w = gl.where(ok, gl.exp(lse - m), 0.0)
            acc = gl.sum(gl.where(ok[:, None], w[:, None] * o, 0.0), 0)
            total = gl.sum(w, 0)
        else:
            m_vec = gl.full([BLOCK_N], float("-inf"), gl.float32, layout=gl.SliceLayout(1, LM))
            for n0 in range(0, N, BLOCK_N):
                n = n0 + offs_n
                lse = gl.load(l_base + n * s_ln, mask=n < N, other=float("-inf"))
                m_vec = gl.maximum(m_vec, gl.where(gl.abs(lse) < float("inf"), lse, float("-inf")))
            m = gl.max(m_vec, 0)
            m = gl.where(m == float("-inf"), 0.0, m)
            tot_vec = gl.zeros([BLOCK_N], gl.float32, layout=gl.SliceLayout(1, LM))
            acc = gl.zeros([BLOCK_R], gl.float32, layout=gl.SliceLayout(0, LM))
            for n0 in range(0, N, BLOCK_N):
                n = n0 + offs_n
                lse = gl.load(l_base + n * s_ln, mask=n < N, other=float("-inf"))
                ok = gl.abs(lse) < float("inf")
                w = gl.where(ok, gl.exp(lse - m), 0.0)
                o = gl.load(o_base + n[:, None].to(gl.int64) * s_on + offs_r[None, :],
                            mask=ok[:, None] & mask_r[None, :], other=0.0)
                acc += gl.sum(w[:, None] * o, 0)
                tot_vec += w
            total = gl.sum(tot_vec, 0)
        out = acc / gl.where(total > 0, total, 1.0)
        gl.store(Out + b * s_outb + h * s_outh + offs_r, out.to(Out.dtype.element_ty), mask=mask_r)
        if rb == 0:
            gl.store(Lse + b * s_lseb + h * s_lseh, gl.where(total > 0, m + gl.log(total), float("-inf")))

    @gluon.jit
    def column_softmax(s, m_i, l_i):
        """The online softmax of the swap-AB kernels (decode_swapab.py, decode_fp8_swapab.py) over one tile's scores
        S^T [tokens, heads] (base 2, scaled, masked -inf), per head = per COLUMN: (m_new, alpha = the rescale of
        what was accumulated under m_i, p, l_i) with l_i [tokens, heads] the per-thread partial column sums, reduced
        once at the end (`column_softmax_end`)."""
        m_new = gl.maximum(m_i, gl.max(s, 0))
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # no token yet: stays NaN-free
        alpha = gl.exp2(m_i - m_use)
        p = gl.exp2(s - m_use[None, :])
        return m_new, alpha, p, l_i * alpha[None, :] + p

    @gluon.jit
    def column_softmax_end(m_i, l_i, O_L: gl.constexpr):
        """(natural-log lse per head, -inf where no token was seen; 1 / the head's sum in O^T's column layout, 1
        there) from `column_softmax`'s running max and partial sums."""
        l_tot = gl.sum(l_i, 0)
        has = l_tot > 0
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_tot, 1.0))) * 0.6931471805599453, float("-inf"))
        return lse, gl.convert_layout(1.0 / gl.where(has, l_tot, 1.0), gl.SliceLayout(0, O_L))

    @gluon.jit
    def split_bounds(n, split, n_splits, BLOCK_N: gl.constexpr):
        """[start, end) of this split's tokens and its number of whole tiles (the split length is rounded to whole
        tiles, so only a split's last tile can be partial)."""
        split_len = gl.cdiv(gl.cdiv(n, n_splits), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = gl.minimum(start + split_len, n)
        return start, end, gl.maximum(end - start, 0) // BLOCK_N

    @gluon.jit
    def block_token_end(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal, BLOCK_H: gl.constexpr):
        """Several query tokens per request folded into the rows (row j * heads_per_query + h: head h of query
        token j; kernels/_util.query_limit_args has the two forms of Lens): the end of this head block's token
        range, its last row's limit (limits grow with the query token)."""
        last = (gl.minimum(hb * BLOCK_H + BLOCK_H, H) - 1) // heads_per_query
        return gl.maximum(gl.load(Lens + b * s_lenb + last * s_lenq) + causal * (last - n_query + 1), 0)

    @gluon.jit
    def row_limits(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal, layout: gl.constexpr,
                   BLOCK_H: gl.constexpr):
        """Each row's limit in `layout` (the row sees tokens t < limit; rows past H none): Lens[b * s_lenb +
        j * s_lenq] + causal * (j - n_query + 1) for query token j."""
        oh = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=layout)
        tok = oh // heads_per_query
        limit = gl.load(Lens + b * s_lenb + tok * s_lenq, mask=oh < H, other=0) + causal * (tok - n_query + 1)
        return gl.where(oh < H, limit, 0)

    @gluon.jit
    def query_rows(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal, layout: gl.constexpr,
                   BLOCK_H: gl.constexpr):
        """(`block_token_end`, `row_limits`): a head block's token range and its rows' limits, for the kernels
        that hold both in one warp group."""
        return (block_token_end(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal, BLOCK_H),
                row_limits(Lens, b, hb, H, n_query, heads_per_query, s_lenb, s_lenq, causal, layout, BLOCK_H))

    @gluon.jit
    def q_to_smem(Qn, Qp, b, hb, H, s_qnb, s_qnh, s_qpb, s_qph, dt: gl.constexpr, RH: gl.constexpr,
                  P: gl.constexpr, BLOCK_H: gl.constexpr, LD: gl.constexpr):
        """q's latent halves and rope part of this head block into shared memory, once: the A operand of every
        score MMA (heads past H are zero)."""
        offs_h = hb * BLOCK_H + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, LD))
        offs_r = gl.arange(0, RH, layout=gl.SliceLayout(0, LD))
        offs_p = gl.arange(0, P, layout=gl.SliceLayout(0, LD))
        mask_h = offs_h < H
        qn_rows = b * s_qnb + offs_h * s_qnh
        q_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, RH], dt)
        qp_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_H, P], dt)
        q0_s = gl.allocate_shared_memory(dt, [BLOCK_H, RH], q_sl, load_rows(Qn, qn_rows, offs_r, mask_h, RH))
        q1_s = gl.allocate_shared_memory(dt, [BLOCK_H, RH], q_sl, load_rows(Qn + RH, qn_rows, offs_r, mask_h, RH))
        qp_s = gl.allocate_shared_memory(dt, [BLOCK_H, P], qp_sl,
                                         load_rows(Qp, b * s_qpb + offs_h * s_qph, offs_p, mask_h, P))
        return q0_s, q1_s, qp_s
