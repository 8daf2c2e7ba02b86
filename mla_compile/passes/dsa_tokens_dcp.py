"""DSA sparse steps with S > 1 query tokens under DCP: `passes/dsa_tokens.py`'s one-request-per-query-token form over
each rank's key shard (`passes/dsa_dcp.py`'s S = 1 form, row by row).

Query token j of request b is row b*S + j: its valid tokens (A's row j, global positions) -> the tokens this rank
holds (`layout.local_mask`) -> their token table over the request's block table -> `dsa.dcp_indexer_topk` (exact
global top-k of the row, this rank's slots) -> `mla.dcp_decode` (or `mla.tp_dcp_decode`) over those slots with
q [B*S, H, *]. Every rank folds the same rows, so the ops' group calls line up. Empty rows (no valid token in A's
global row): 0 (SDPA), NaN (eager, -inf), or every slot this rank holds with a zero query (eager, finfo.min: HF's
flat softmax over all L positions), as `dsa_dcp`.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import layout
from . import attention_emit as E
from . import attention_mask as masks
from ._fx import Builder, batch_shape as _shape, val
from .attention_match import LatentSource, Site

aten = torch.ops.aten


def _rows_slots(b: Builder, table: fx.Node, src: LatentSource, B, S: int, width: int) -> fx.Node:
    """Local positions [B*S, width] (row b*S + j: request b's) -> physical slots of this rank's shard."""
    t = b.call(aten.reshape.default, table, [E._lead(B), S * width])  # request b's rows: one block-table row
    return b.call(aten.reshape.default, E._paged_slots(b, t, src), [E._lead(B, S), width])


def emit(b: Builder, site: Site, src: LatentSource, q_abs, q_pe, valid: fx.Node, B, S: int, L: int, memo: E.Memo):
    """lat [B*S, H, R] (empty rows as HF gives them). q_abs [B*S, H, R], q_pe [B*S, H, P]; valid bool [B*S, L]:
    A's rows (global positions)."""
    sp, shard = site.sparse, site.sparse.shard
    n, r, group = src.dcp_size, src.dcp_rank, src.group_name
    device = val(site.q).device
    cap = _shape(src.block_table)[1] * _shape(src.ckv)[1]  # local token capacity
    BS = E._times(b, B, S)

    def indexer():  # a GLM-DSA "shared" layer reuses the previous layer's selection: one call
        local = layout.local_mask(valid, L, n, r, cap, aten=b.aten)
        table, counts = E._emit_token_table(b, local, BS, cap, device)
        _, _, Hi, Di = _shape(sp.q)
        keys = b.call(aten.reshape.default, shard.src.ckv, [-1, 1, Di])
        qi = b.call(aten.reshape.default, sp.q, [E._lead(B, S), Hi, Di])
        w = b.call(aten.reshape.default, sp.weights, [E._lead(B, S), Hi])
        lens = layout.lens_holding(counts, n, aten=b.aten)
        return b.call(torch.ops.dsa.dcp_indexer_topk.default, qi, w, keys, _rows_slots(b, table, shard.src, B, S, cap),
                      lens, sp.k, sp.scale, n, r, group, False)

    idx = memo.get(b, ("dcp_indexer_tokens", sp.topk), indexer)  # [B*S, k]
    count = b.call(aten._to_copy.default, b.call(aten.sum.dim_IntList, b.call(aten.ge.Scalar, idx, 0), [-1]),
                   dtype=torch.int32)
    table = b.call(aten.clamp_min.default, idx, 0)
    empty_rows = site.proof.empty_rows
    empty = None
    if empty_rows != masks.EMPTY_ZERO:  # emptiness is global: from A's whole row, before sharding
        empty = b.call(aten.logical_not.default, b.call(aten.any.dim, valid, -1))
    if empty_rows == masks.EMPTY_UNIFORM:  # every slot this rank holds of the L positions, zero queries
        table, count = _uniform_rows(b, src, table, count, empty, B, S, L, cap, device, memo)
        rows = b.call(aten.unsqueeze.default, b.call(aten.unsqueeze.default, empty, 1), 2)
        q_abs = b.call(aten.where.ScalarSelf, rows, 0.0, q_abs)
        q_pe = b.call(aten.where.ScalarSelf, rows, 0.0, q_pe)
    R = _shape(site.latent)[-1]
    ckv, kpe, ckv_scale = E._flat_latent(b, src, B, L, R, site.rope)
    op = torch.ops.mla.tp_dcp_decode.default if src.heads_sharded else torch.ops.mla.dcp_decode.default
    # check_lens=False: count * n is this rank's own count, not a length every rank shares
    res = b.call(op, q_abs, q_pe, ckv, kpe, table, layout.lens_holding(count, n, aten=b.aten), site.scale, n, r, group,
                 False, *E._scale_arg(ckv_scale))
    lat = b.item(res, 0)
    if empty_rows == masks.EMPTY_NAN:
        lat = b.call(aten.where.ScalarSelf, E._rows(b, empty), float("nan"), lat)
    return lat


def _uniform_rows(b: Builder, src: LatentSource, table, count, empty, B, S: int, L: int, cap: int, device, memo):
    """(table [B*S, W], count [B*S]): the selection, or for an empty row every slot this rank holds of the L static
    positions (W = max(topk, cap))."""
    k = _shape(table)[1]

    def every():
        allv = b.call(aten.full.default, [E._lead(B), L], True, dtype=torch.bool, device=device)
        local = layout.local_mask(allv, L, src.dcp_size, src.dcp_rank, cap, aten=b.aten)
        t, c = E._emit_token_table(b, local, B, cap, device)
        slots = b.call(aten.unsqueeze.default, E._paged_slots(b, t, src), 1)  # [B, 1, cap] -> every query row
        slots = b.call(aten.reshape.default, b.call(aten.expand.default, slots, [B, S, cap]), [E._lead(B, S), cap])
        c = b.call(aten.reshape.default, b.call(aten.expand.default, b.call(aten.unsqueeze.default, c, 1), [B, S]),
                   [E._lead(B, S)])
        return slots, c

    all_table, all_count = memo.get(b, ("dcp_every_slot_tokens", src.block_table, L, S), every)
    W = max(k, cap)
    sel = b.call(aten.constant_pad_nd.default, table, [0, W - k], 0) if W > k else table
    full = b.call(aten.constant_pad_nd.default, all_table, [0, W - cap], 0) if W > cap else all_table
    rows = b.call(aten.unsqueeze.default, empty, 1)
    return b.call(aten.where.self, rows, full, sel), b.call(aten.where.self, empty, all_count, count)
