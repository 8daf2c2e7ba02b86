"""DSA indexer ops in Triton: `dsa::indexer_topk` (order keys kernel + torch.topk + slots kernel) and
`dsa::k_only_indices` (the slots kernel alone).

Shapes only decide the work: the key row spans the block table's capacity T = MP * PS, tokens at or beyond a
request's length get `topk_order.NONE`, and picked keys become physical slots (NONE: -1). Rows with seq_len <= topk
skip their logits and take the k-only identity slots (no mixed-batch cliff). No host sync, so CUDA graphs capture
every launch.

A call is two or three steps: the logits kernel writes each token's int64 order key (`topk_order`: score
descending, ties to the lower token index; `_order_key` is the kernels' copy of that definition) instead of a float
score; then, for key rows up to RADIX_MAX_TOKENS, one launch selects each row's topk largest keys (a radix select,
one program per row, as peers' indexer top-k kernels do) and writes their slots; for longer rows `torch.topk`
takes the largest keys and the slots kernel turns them into slots. Rows with seq_len <= topk get the identity slots
either way. A block table of at most topk tokens leaves every row an identity row: the slots kernel alone.
S query tokens per request (multi-token decode) are B*S rows of their own: row r is query token r % S of request
r // S, its table row that request's and its length derived in the kernels (`_row_tokens`), so no per-call table
copy or length arithmetic runs around the launches.
`indexer_topk_plan` builds the launches once per call signature (ops/_plans.py); its plan allocates and launches
only (issue 29: float scores then ~12 aten ops to slots took ~450 us of host time per eager call on the H200;
torch.topk alone ~18 us of the 42.8 left).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import topk_order
from ._util import block, cdiv, dot_mode, mma, next_power_of_2, pdl_enter, pdl_launch
from ._launch import bind
from .scratch import Scratch, empty_maker

_NONE = tl.constexpr(topk_order.NONE)
_LOW = tl.constexpr(2**32 - 1)  # the key's index half (topk_order._LOW)
_BLOCK_T = 64  # token positions per logits program


@triton.jit
def _order_key(score, index):
    """int64 `topk_order.order_keys` of a valid token: score float32, index int in [0, 2^32) (same shape).
    A second implementation of that definition (tests assert bit equality with it): NaN and -inf -> -max, +inf ->
    +max, -0.0 -> +0.0, then the float's bits as an order-preserving int32 above the index's complement."""
    big = 3.4028234663852886e38
    s = tl.where(score != score, -big, tl.minimum(tl.maximum(score, -big), big))
    bits = s.to(tl.int32, bitcast=True)
    # -0.0 by its bits, not by `s + 0.0`: a compiler may fold x + 0.0 away, a compare on integers stays
    bits = tl.where(bits == -2147483648, 0, bits)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    return (ordered << 32) + (_LOW - index.to(tl.int64))


@triton.jit
def _row_tokens(Lens, row, n_query, s_lb):
    """(request, tokens) of query row `row`: request row // n_query, whose query token j = row % n_query sees
    Lens[request] - n_query + 1 + j tokens (the lengths count the n_query new tokens), at least 0
    (`ops.attention.query_limits`). One query token: the row's own length."""
    req = row // n_query
    n = tl.load(Lens + req * s_lb)
    return req, tl.maximum(n + (row - req * n_query + 1 - n_query), 0)


@triton.jit
def _indexer_logits_kernel(Q, W, K, Table, Lens, Out, scale, Hi, Di, PS, T, topk, idx_mul, idx_add, n_query,
                           s_qb, s_qh, s_qd, s_wb, s_wh, s_kp, s_ks, s_kd, s_tb, s_tp, s_lb, s_ob,
                           BLOCK_HI: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
                           DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, KEYS: tl.constexpr,
                           PDL: tl.constexpr = False):
    """Out[b, t] for t < T: the order key of token t (KEYS) or its float32 score; NONE / -inf at t >= seq_len and in
    rows with seq_len <= topk (their K reads are masked off: the caller gives them identity slots; topk -1 skips
    none). The key's index is t * idx_mul + idx_add (a DCP rank's global token index; t on a single rank). Row b:
    query row b (`_row_tokens`: its request's table row and its tokens)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    req, n = _row_tokens(Lens, b, n_query, s_lb)
    mask_t = (offs_t < n) & (n > topk)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < Hi
    mask_d = offs_d < Di
    q = tl.load(Q + b * s_qb + offs_h[:, None] * s_qh + offs_d[None, :] * s_qd,
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(W + b * s_wb + offs_h * s_wh, mask=mask_h, other=0.0)
    page = tl.load(Table + req * s_tb + (offs_t // PS) * s_tp, mask=mask_t, other=0).to(tl.int64)
    k = tl.load(K + page[:, None] * s_kp + (offs_t % PS)[:, None] * s_ks + offs_d[None, :] * s_kd,
                mask=mask_t[:, None] & mask_d[None, :], other=0.0)
    logits = mma(q, tl.trans(k), tl.zeros([BLOCK_HI, BLOCK_T], tl.float32), DOT_PREC, DOT_UPCAST)  # [Hi, T]
    logits = tl.maximum(logits * scale, 0.0)
    score = tl.sum(logits * w[:, None], 0)
    if KEYS:
        out = tl.where(mask_t, _order_key(score, offs_t.to(tl.int64) * idx_mul + idx_add), _NONE)
    else:
        out = tl.where(mask_t, score, float("-inf"))
    tl.store(Out + b * s_ob + offs_t, out, mask=offs_t < T)


@triton.jit
def _slots_kernel(Top, Table, Lens, Out, PS, capacity, topk, n_query, s_kb, s_tb, s_tp, s_lb, s_ob,
                  BLOCK: tl.constexpr, KEYED: tl.constexpr, PDL: tl.constexpr = False):
    """Out[b, j] for j < topk, int32: the physical slot block_table[b, t // PS] * PS + t % PS of the j-th token, -1
    past the selection. Rows with seq_len <= topk (every row when not KEYED): token j itself, for j < min(seq_len,
    capacity) (the k-only identity). Other rows (KEYED): the token of key Top[b, j] (NONE: -1); Top holds topk keys
    per row, largest first. Row b: query row b (`_row_tokens`)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    req, n = _row_tokens(Lens, b, n_query, s_lb)
    pos = offs.to(tl.int64)
    valid = offs < tl.minimum(n, capacity)
    if KEYED:
        ranked = n > topk  # an identity row's keys are all NONE (its logits were skipped): not read
        key = tl.load(Top + b * s_kb + offs, mask=(offs < topk) & ranked, other=_NONE)
        pos = tl.where(ranked, _LOW - (key & _LOW), pos)  # topk_order.key_index
        valid = tl.where(ranked, key != _NONE, valid)
    page = tl.load(Table + req * s_tb + (pos // PS) * s_tp, mask=valid, other=0).to(tl.int64)
    # int64 products truncated to int32: the bits an int32 product would wrap to (the ops check that slots fit)
    slot = tl.where(valid, page * PS + pos % PS, -1).to(tl.int32)
    tl.store(Out + b * s_ob + offs, slot, mask=offs < topk)


_SIGN = tl.constexpr(-(2**63))  # int64 sign bit: key ^ _SIGN orders as unsigned as the key does as signed
# radix select + slots (one launch) for key rows of at most this many tokens; longer rows take torch.topk and the slots
# kernel. H200, the whole op as a CUDA-graph replay, V3.2's indexer (benchmarks/indexer_select.py, RESULTS.md
# 2026-12-04): radix / torch 0.23 at B 1 T 1K (k 256); k 2048: 0.68 at B 8 4K, 0.75 / 0.62 at B 8 / 64 8K, 0.72 /
# 0.84 at B 8 / 32 16K, 1.08 at B 8 32K (one program per row loses on long rows)
RADIX_MAX_TOKENS = 16384
# the radix select sorts its topk picks in registers: built for sm_90a without spills up to 8192 (16 warps), timed at
# 2048 (V3.2's and GLM-DSA's index_topk); larger topk takes torch.topk
RADIX_MAX_TOPK = 4096


@triton.jit
def _select_slots_kernel(Keys, Top, Table, Lens, Out, T, PS, topk, n_query, s_kb, s_top, s_tb, s_tp, s_lb, s_ob,
                         BLOCK: tl.constexpr, KBLOCK: tl.constexpr, KEYS_OUT: tl.constexpr = False,
                         PDL: tl.constexpr = False):
    """`_slots_kernel` over each row's topk largest keys of Keys[b, :seq_len], selected here (one program per row):
    Out[b, j] int32 for j < topk, the slot of the j-th largest key's token (largest first) in rows with seq_len >
    topk (which hold seq_len distinct real keys); identity slots in the other rows (their keys are not read).

    The select is a radix select over the keys as unsigned 64-bit values, 8 bits a pass, most significant first:
    each pass histograms the digit of the keys matching the prefix found so far and picks the digit holding the
    topk-th largest, stopping once every key matching the prefix is needed. The topk keys >= the prefix are then
    compacted into Top[b] (row order), read back, sorted descending and mapped to slots.

    KEYS_OUT: Out[b] int64 [topk] gets the keys themselves, largest first, NONE-padded: every row's keys are read
    (its seq_len real keys: a DCP rank's candidates), rows with seq_len <= topk give all of theirs (Table unused).
    Row b: query row b (`_row_tokens`)."""
    pdl_enter(PDL)
    b = tl.program_id(0).to(tl.int64)
    req, n = _row_tokens(Lens, b, n_query, s_lb)
    if KEYS_OUT:
        span = tl.minimum(n, T)  # keys past seq_len are NONE: not read
        ranked = span > topk
    else:
        ranked = n > topk
        span = tl.where(ranked, tl.minimum(n, T), 0)  # identity rows read no key
    keys_row = Keys + b * s_kb
    offs = tl.arange(0, BLOCK)
    digits = tl.arange(0, 256)
    prefix = tl.zeros((), dtype=tl.uint64)
    mask = tl.zeros((), dtype=tl.uint64)
    need = topk  # keys still to take among those matching the prefix
    shift = 56
    done = span <= topk  # no select: every key of the row is taken (none in an identity row)
    while (shift >= 0) & (not done):
        hist = tl.zeros((256,), dtype=tl.int32)
        for start in range(0, span, BLOCK):
            idx = start + offs
            u = (tl.load(keys_row + idx, mask=idx < span, other=_NONE) ^ _SIGN).to(tl.uint64, bitcast=True)
            match = ((u & mask) == prefix) & (idx < span)
            hist += tl.histogram(((u >> shift) & 255).to(tl.int32), 256, mask=match)
        # at_least[d]: matching keys with digit >= d; the topk-th largest has the largest d with at_least[d] >= need
        at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist
        pick = tl.sum((at_least >= need).to(tl.int32)) - 1
        above = tl.sum(tl.where(digits > pick, hist, 0))
        equal = tl.sum(tl.where(digits == pick, hist, 0))
        need -= above
        prefix |= pick.to(tl.uint64) << shift
        mask |= tl.full((), 255, tl.uint64) << shift
        done = equal == need
        shift -= 8
    top_row = Top + b * s_top
    base = 0
    for start in range(0, span, BLOCK):  # exactly min(span, topk) keys (distinct) have masked values >= the prefix
        idx = start + offs
        key = tl.load(keys_row + idx, mask=idx < span, other=_NONE)
        take = (((key ^ _SIGN).to(tl.uint64, bitcast=True) & mask) >= prefix) & (idx < span)
        tl.store(top_row + base + tl.cumsum(take.to(tl.int32), 0) - 1, key, mask=take)
        base += tl.sum(take.to(tl.int32))
    tl.debug_barrier()  # every thread's compaction stores before any thread reads them back
    ko = tl.arange(0, KBLOCK)
    key = tl.sort(tl.load(top_row + ko, mask=ko < tl.minimum(span, topk), other=_NONE), descending=True)
    if KEYS_OUT:
        tl.store(Out + b * s_ob + ko, key, mask=ko < topk)
    else:
        pos = tl.where(ranked, _LOW - (key & _LOW), ko.to(tl.int64))  # topk_order.key_index, or the identity
        valid = tl.where(ranked, ko < topk, ko < tl.minimum(n, T))
        page = tl.load(Table + req * s_tb + (pos // PS) * s_tp, mask=valid, other=0).to(tl.int64)
        slot = tl.where(valid, page * PS + pos % PS, -1).to(tl.int32)
        tl.store(Out + b * s_ob + ko, slot, mask=ko < topk)


def _logits_launch(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, keys: bool, index=(1, 0),
                   n_query: int = 1):
    """`launch(q, weights, k_cache, block_table, seq_lens, out)` writes out [rows, T] (contiguous; int64 keys or
    float32 scores) for inputs of this signature. q [rows, Hi, Di] (rows = B * n_query query rows, `_row_tokens`),
    any strides; topk -1: no row skips its logits; the keys' index of table position t is t * index[0] + index[1]."""
    rows, Hi, Di = q.shape
    PS = k_cache.shape[1]
    T = block_table.shape[1] * PS
    bound = bind(_indexer_logits_kernel, (rows, cdiv(T, _BLOCK_T)), BLOCK_HI=block(Hi), BLOCK_D=block(Di),
                 BLOCK_T=_BLOCK_T, KEYS=keys, **dot_mode(q.dtype), num_warps=4, **pdl_launch(q.device))
    numbers = (float(sm_scale), Hi, Di, PS, T, topk, *index, n_query, *q.stride(), *weights.stride(),
               *k_cache.stride(), *block_table.stride(), seq_lens.stride(0), T)

    def launch(q, weights, k_cache, block_table, seq_lens, out):
        bound(q, weights, k_cache, block_table, seq_lens, out, *numbers)

    return launch


def _slots_plan(block_table, seq_lens, page_size: int, topk: int, keyed: bool, n_query: int = 1, out_shape=None):
    """`plan(top, block_table, seq_lens)` -> int32 [rows, topk] (or out_shape, its rows contiguous) over rows = B *
    n_query query rows (`_slots_kernel`; top int64 [rows, topk] keys when keyed, else None) for tables and lengths
    of this signature."""
    rows = block_table.shape[0] * n_query
    shape, device = out_shape or (rows, topk), block_table.device
    if rows == 0:
        return lambda top, block_table, seq_lens: torch.empty(shape, dtype=torch.int32, device=device)
    blk = min(1024, next_power_of_2(topk))
    bound = bind(_slots_kernel, (rows, cdiv(topk, blk)), BLOCK=blk, KEYED=keyed, num_warps=4, **pdl_launch(device))
    numbers = (page_size, block_table.shape[1] * page_size, topk, n_query)
    strides = (*block_table.stride(), seq_lens.stride(0), topk)  # the output's row stride last

    fresh = empty_maker(shape, torch.int32, device)

    def plan(top, block_table, seq_lens):
        out = fresh()
        bound(top, block_table, seq_lens, out, *numbers, 0 if top is None else top.stride(0), *strides)
        return out

    return plan


def _select(select: str, T: int, topk: int) -> str:
    """The top-k select for rows of T keys: "radix" or "torch" (`select` "auto" resolved; the others checked)."""
    if select not in ("auto", "radix", "torch"):
        raise ValueError(f"select: expected 'auto', 'radix' or 'torch', got {select!r}")
    if select == "radix" and topk > RADIX_MAX_TOPK:
        raise ValueError(f"select: 'radix' takes topk <= {RADIX_MAX_TOPK} (its picks are sorted in registers), "
                         f"got topk {topk}; use 'torch' or 'auto'")
    if select == "auto":
        return "radix" if T <= RADIX_MAX_TOKENS and topk <= RADIX_MAX_TOPK else "torch"
    return select


def _radix_launch(block_table, seq_lens, page_size: int, topk: int, keys_out: bool, n_query: int = 1):
    """(scratch, bound, numbers) of `_select_slots_kernel` for tables and lengths of this signature: `scratch.get()`
    -> (keys int64 [rows, T] for the logits kernel, the compaction buffer; rows = B * n_query query rows), then
    `bound(keys, top, block_table, seq_lens, out, *numbers)`."""
    rows, T, device = block_table.shape[0] * n_query, block_table.shape[1] * page_size, block_table.device
    kblock = next_power_of_2(topk)
    # the keys and the compacted top keys are the call's intermediates: scratch where it is safe (scratch.py)
    reused = Scratch([(rows, 2 * T), (rows, 2 * kblock)], device,
                     lambda raw, top: (raw.view(torch.int64), top.view(torch.int64)))
    blk, warps = (1024, 8) if T <= 2048 else (4096, 16)  # the lab probe's fastest per row length (lab README)
    bound = bind(_select_slots_kernel, (rows,), BLOCK=blk, KBLOCK=kblock, KEYS_OUT=keys_out, num_warps=warps,
                 **pdl_launch(device))
    return reused, bound, (T, page_size, topk, n_query, T, kblock, *block_table.stride(), seq_lens.stride(0), topk)


def _selected_plan(logits, block_table, lens, page_size: int, topk: int, out_dtype, after_topk, n_query: int = 1,
                   out_shape=None):
    """`plan(q, weights, k_cache, block_table, lens)`: the logits launch into scratch keys [rows, T] (rows = B *
    n_query query rows), then the top-k select: `after_topk(keys, block_table, lens)` (torch.topk and what follows
    it), or where that is None the radix select writing out_dtype [rows, topk] (or out_shape; int32: slots, int64:
    the keys)."""
    rows, T, device = block_table.shape[0] * n_query, block_table.shape[1] * page_size, block_table.device
    if after_topk is None:
        reused, bound, numbers = _radix_launch(block_table, lens, page_size, topk, out_dtype == torch.int64, n_query)
        fresh = empty_maker(out_shape or (rows, topk), out_dtype, device)

        def plan(q, weights, k_cache, block_table, lens):
            keys, top = reused.get()
            logits(q, weights, k_cache, block_table, lens, keys)
            out = fresh()
            bound(keys, top, block_table, lens, out, *numbers)
            return out

        return plan
    # the keys are the call's intermediate (torch.topk reads them): scratch where it is safe (kernels/scratch.py)
    reused = Scratch([(rows, 2 * T)], device, lambda raw: raw.view(torch.int64))

    def plan(q, weights, k_cache, block_table, lens):
        keys = reused.get()
        logits(q, weights, k_cache, block_table, lens, keys)
        return after_topk(keys, block_table, lens)

    return plan


def indexer_topk_plan(q, weights, k_cache, block_table, seq_lens, topk: int, sm_scale: float, select: str = "auto",
                      n_query: int = 1, out_shape=None):
    """`plan(q, weights, k_cache, block_table, seq_lens)` -> `dsa::indexer_topk` int32 [B, topk] for inputs of this
    signature (ops/_plans.py): q [B, Hi, Di], weights float32 [B, Hi], k_cache [NP, PS, Di], block_table int32
    [B, MP], seq_lens int32 [B]. A plan call launches the logits kernel into scratch keys [B, T] (T = MP * PS),
    then the top-k `select`: "radix" (one launch: `_select_slots_kernel`; topk <= RADIX_MAX_TOPK) or "torch"
    (torch.topk, then the slots kernel); "auto" takes radix up to RADIX_MAX_TOKENS and RADIX_MAX_TOPK. With
    T <= topk only the slots kernel runs (every row is an identity row).
    n_query = S > 1 query tokens per request: q [B*S, Hi, Di] / weights [B*S, Hi] (row b*S + j: token j of request
    b; a view of the op's [B, S, ...] may be handed over as it is, the kernels read it by pointer and these
    strides), seq_lens [B] counting the S new tokens (`_row_tokens`); the result [B*S, topk], or out_shape (e.g.
    [B, S, topk])."""
    PS = k_cache.shape[1]
    T, rows = block_table.shape[1] * PS, q.shape[0]
    select = _select(select, T, topk)  # checked even where no select runs
    if T <= topk or rows == 0:  # seq_len <= T <= topk in every row (or no row): no key is ever read
        identity = k_only_plan(block_table, seq_lens, PS, topk, n_query, out_shape)
        return lambda q, weights, k_cache, block_table, seq_lens: identity(block_table, seq_lens)
    logits = _logits_launch(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, keys=True, n_query=n_query)
    if select == "radix":
        return _selected_plan(logits, block_table, seq_lens, PS, topk, torch.int32, None, n_query, out_shape)
    slots = _slots_plan(block_table, seq_lens, PS, topk, keyed=True, n_query=n_query, out_shape=out_shape)
    # T > topk: every row yields topk keys, largest first (distinct for valid tokens, so the set is unique)
    return _selected_plan(logits, block_table, seq_lens, PS, topk, torch.int32,
                          lambda keys, block_table, seq_lens: slots(torch.topk(keys, topk, dim=1).values, block_table,
                                                                    seq_lens), n_query)


def indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale, select: str = "auto") -> torch.Tensor:
    """int32 [B, topk]: `dsa::indexer_topk` for q [B, Hi, Di] (one call: a fresh `indexer_topk_plan`)."""
    return indexer_topk_plan(q, weights, k_cache, block_table, seq_lens, topk, sm_scale, select)(
        q, weights, k_cache, block_table, seq_lens)


def candidate_keys_plan(q, weights, k_cache, block_table, local_lens, topk: int, sm_scale: float, dcp_size: int,
                        dcp_rank: int, select: str = "auto"):
    """`plan(q, weights, k_cache, block_table, local_lens)` -> `dsa::dcp_local_candidates` int64 [B, topk] for inputs
    of this signature: this DCP rank's top-k order keys over its shard (table position t carries global token
    t * dcp_size + dcp_rank), largest first, NONE-padded. The logits kernel (no row skips its keys: a short shard
    still offers its tokens), then the radix select writing keys, or torch.topk (`select` as `indexer_topk_plan`)."""
    PS = k_cache.shape[1]
    T = block_table.shape[1] * PS
    B, device = q.shape[0], q.device
    select = _select(select, T, topk)
    if B == 0 or T == 0:
        return lambda q, weights, k_cache, block_table, local_lens: torch.full(
            (B, topk), topk_order.NONE, dtype=torch.int64, device=device)
    logits = _logits_launch(q, weights, k_cache, block_table, local_lens, sm_scale, -1, keys=True,
                            index=(dcp_size, dcp_rank))
    return _selected_plan(logits, block_table, local_lens, PS, topk, torch.int64,
                          None if select == "radix" else lambda keys, *_: topk_order.top_keys(keys, topk))


def _logits(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, dtype) -> torch.Tensor:
    B = q.shape[0]
    out = torch.empty((B, block_table.shape[1] * k_cache.shape[1]), dtype=dtype, device=q.device)
    if out.numel():
        _logits_launch(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, dtype == torch.int64)(
            q, weights, k_cache, block_table, seq_lens, out)
    return out


def indexer_keys(q, weights, k_cache, block_table, seq_lens, sm_scale, topk) -> torch.Tensor:
    """int64 [B, MP * PS]: the order key (`topk_order.order_keys`, index = token position) of every token position,
    NONE at and beyond the request's length and in rows with seq_len <= topk (their logits are skipped)."""
    return _logits(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, torch.int64)


def indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale, topk) -> torch.Tensor:
    """float32 [B, MP * PS]: the indexer score `indexer_keys` orders, as computed (NaN and +-inf kept: the key
    clamps them), -inf where `indexer_keys` has NONE."""
    return _logits(q, weights, k_cache, block_table, seq_lens, sm_scale, topk, torch.float32)


def k_only_plan(block_table, seq_lens, page_size: int, topk: int, n_query: int = 1, out_shape=None):
    """`plan(block_table, seq_lens)` -> `k_only_indices(...)` for tables and lengths of this signature; n_query = S
    query tokens per request: [B*S, topk] rows (or out_shape), as `indexer_topk_plan`."""
    slots = _slots_plan(block_table, seq_lens, page_size, topk, keyed=False, n_query=n_query, out_shape=out_shape)
    return lambda block_table, seq_lens: slots(None, block_table, seq_lens)


def k_only_indices(block_table, seq_lens, page_size, topk) -> torch.Tensor:
    """int32 [B, topk]: `dsa::k_only_indices`, slots of tokens 0 .. min(seq_len, topk) - 1 in order, then -1."""
    return k_only_plan(block_table, seq_lens, page_size, topk)(block_table, seq_lens)
