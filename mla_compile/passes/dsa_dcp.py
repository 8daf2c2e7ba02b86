"""DSA sparse graphs under DCP: HF's indexer over the gathered key cache -> `dsa.dcp_indexer_topk` over each rank's
key shard, attention over each rank's selected slots merged by lse.

Our DCP cache (`integrations.hf.MLAPagedLayer`) keeps the indexer keys in the latent's pages (same block table,
token-cyclic: token t on rank t % n) and hands HF the whole key cache as `gather_latent(keys, <P = 0>, ...)[0]
.squeeze(1)`. `key_shard` proves HF's indexer keys are exactly that, over the latent's own block table and group.
Then `KeyShard.emit` writes, for a site whose mask is `A & ~topk-mask` (`dsa_indexer.match_sparse_indexer`)::

    local    = layout.local_mask(valid(A), L, n, r, cap)           the valid tokens this rank holds, local order
    table, c = token table of local                                 (as the DCP dense path)
    idx      = dsa.dcp_indexer_topk(q, w, key pages [N,1,Di], physical slots of table, c * n, k, s, n, r, group,
                                    check_lens=False)               this rank's slots of the global top-k
    out, lse = mla.dcp_decode (or mla.tp_dcp_decode for sharded heads) over idx as a token table
               (clamp(idx, 0), count(idx >= 0) * n, check_lens=False)

Same set as HF: HF's topk(score masked by A, k) over the L static positions, then `& A`, attends the top-min(k,
count) valid tokens by score; `dcp_indexer_topk` returns exactly that set over all ranks (same score formula, the
exact global top-k). Ties at the k-th place: HF's torch.topk defines no rule; ours is (token-table position, rank).
The key cache is never gathered: the gather is dead after the rewrite (and removed with HF's indexer).
Empty rows (no valid token in A's global row): 0 (SDPA), NaN (eager, -inf mask), or HF's flat softmax over all L
static positions (eager, finfo.min mask: the row lists every slot each rank holds, with a zero query), as the other
paths.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .. import layout
from ..ops.hf_cache import GATHER_OPS
from . import attention_mask as masks
from ._fx import NoMatch, batch_shape as _shape, is_call, is_fn, same, val
from .attention_emit import _emit_token_table, _flat_latent, _paged_slots, _scale_arg, _valid_of
from .attention_match import LatentSource, _gather_source

aten = torch.ops.aten


class KeyShard:
    """The indexer keys' DCP shard behind HF's indexer, and the emission over it."""

    def __init__(self, src: LatentSource, nodes: set):
        self.src = src  # ckv: the key pages [NP, PS, Di]; block table and group: the latent's
        self.nodes = nodes  # gather -> getitem -> squeeze: where HF reads the pages

    def emit(self, b, site, src: LatentSource, q_abs: fx.Node, q_pe: fx.Node, B, L: int, memo):
        """(the attention op's node (out, lse), empty bool [B] or None) for `attention_emit.emit`."""
        sp = site.sparse
        empty_rows = site.proof.empty_rows
        proof = masks.prove_mask(sp.A, additive=site.impl == "eager", dtypes=site.dtypes)
        valid = _valid_of(b, sp.A, proof, B, L, memo)
        if valid is None:
            raise NoMatch("DSA indexer without an attention mask")
        n, r, group = src.dcp_size, src.dcp_rank, src.group_name
        device = val(site.q).device
        cap = _shape(src.block_table)[1] * _shape(src.ckv)[1]  # local token capacity

        def indexer():  # a GLM-DSA "shared" layer reuses the previous layer's selection: one call
            local = layout.local_mask(valid, L, n, r, cap, aten=b.aten)
            table, counts = _emit_token_table(b, local, B, cap, device)
            _, _, Hi, Di = _shape(sp.q)
            keys = b.call(aten.reshape.default, self.src.ckv, [-1, 1, Di])
            qi = b.call(aten.reshape.default, sp.q, [_lead(B), Hi, Di])
            w = b.call(aten.reshape.default, sp.weights, [_lead(B), Hi])
            lens = layout.lens_holding(counts, n, aten=b.aten)
            return b.call(torch.ops.dsa.dcp_indexer_topk.default, qi, w, keys, _paged_slots(b, table, self.src), lens,
                          sp.k, sp.scale, n, r, group, False)

        idx = memo.get(b, ("dcp_indexer", sp.topk), indexer)
        picked = b.call(aten.ge.Scalar, idx, 0)
        count = b.call(aten._to_copy.default, b.call(aten.sum.dim_IntList, picked, [-1]), dtype=torch.int32)
        table = b.call(aten.clamp_min.default, idx, 0)
        empty = None
        if empty_rows != masks.EMPTY_ZERO:  # emptiness is global: from A's whole row, before sharding
            empty = b.call(aten.logical_not.default, b.call(aten.any.dim, valid, -1))
        if empty_rows == masks.EMPTY_UNIFORM:
            # HF: a row with no valid token attends all L static positions alike (every score the mask constant):
            # such a row lists every slot this rank holds of them, with a zero query (scores 0), as the dense path
            table, count = self._uniform_rows(b, table, count, empty, B, L, cap, device, memo)
            rows = b.call(aten.unsqueeze.default, b.call(aten.unsqueeze.default, empty, 1), 2)
            q_abs = b.call(aten.where.ScalarSelf, rows, 0.0, q_abs)
            q_pe = b.call(aten.where.ScalarSelf, rows, 0.0, q_pe)
        R, P = _shape(site.latent)[-1], site.rope
        ckv, kpe, ckv_scale = _flat_latent(b, src, B, L, R, P)
        op = torch.ops.mla.tp_dcp_decode.default if src.heads_sharded else torch.ops.mla.dcp_decode.default
        # check_lens=False: count * n is this rank's own count, not a length every rank shares
        res = b.call(op, q_abs, q_pe, ckv, kpe, table, layout.lens_holding(count, n, aten=b.aten), site.scale, n, r,
                     group, False, *_scale_arg(ckv_scale))
        return res, empty

    def _uniform_rows(self, b, table, count, empty, B, L: int, cap: int, device, memo):
        """(table [B, W], count [B]): the selection, or for an empty row every slot this rank holds of the L static
        positions (W = max(topk, cap): both fit)."""
        src = self.src
        k = _shape(table)[1]

        def every():
            allv = b.call(aten.full.default, [_lead(B), L], True, dtype=torch.bool, device=device)
            local = layout.local_mask(allv, L, src.dcp_size, src.dcp_rank, cap, aten=b.aten)
            t, c = _emit_token_table(b, local, B, cap, device)
            return _paged_slots(b, t, src), c

        all_table, all_count = memo.get(b, ("dcp_every_slot", src.block_table, L), every)
        W = max(k, cap)
        sel = b.call(aten.constant_pad_nd.default, table, [0, W - k], 0) if W > k else table
        full = b.call(aten.constant_pad_nd.default, all_table, [0, W - cap], 0) if W > cap else all_table
        rows = b.call(aten.unsqueeze.default, empty, 1)
        return b.call(aten.where.self, rows, full, sel), b.call(aten.where.self, empty, all_count, count)


def _lead(B) -> int:
    return B if isinstance(B, int) else -1


def key_shard(keys: fx.Node, src: LatentSource) -> KeyShard:
    """The KeyShard behind HF's indexer keys [B, L, Di], or NoMatch naming what differs."""
    sq = keys
    if not (is_call(sq, (), ("squeeze",)) and len(sq.args) == 2 and sq.args[1] == 1):
        raise NoMatch(f"indexer keys {keys.name} are not our DCP cache's gathered shard (.squeeze(1))")
    item = sq.args[0]
    if not (is_fn(item, {operator.getitem}) and item.args[1] == 0 and is_fn(item.args[0], GATHER_OPS)):
        raise NoMatch(f"indexer keys {keys.name} are not item 0 of the cache's gather")
    gather = item.args[0]
    ks = _gather_source(gather)
    if ks.block_table is not src.block_table:
        raise NoMatch("the indexer key shard and the latent use different block tables")
    if (ks.dcp_size, ks.dcp_rank, ks.group_name) != (src.dcp_size, src.dcp_rank, src.group_name):
        raise NoMatch("the indexer key shard and the latent are sharded over different groups")
    kv, lv = val(ks.ckv), val(src.ckv)
    if not (same(tuple(kv.shape[:2]), tuple(lv.shape[:2])) and _shape(ks.kpe)[-1] == 0):
        raise NoMatch(f"indexer key pages {tuple(kv.shape)} do not match the latent's pages {tuple(lv.shape)}")
    return KeyShard(ks, {gather, item, sq})
