"""The attention rewrite's emission: the absorbed computation that replaces a matched `Site`.

`emit(b, site, src, memo)` inserts, through a `_fx.Builder`, q_abs = q_nope @ W_UK, the attention op
(`mla.decode` / `mla.dcp_decode` over the mask's token table, or `dsa.indexer_topk` + `mla.sparse_decode`), what HF
gives a row with no valid token, and out = lat @ W_UV^T (the algebra is in `passes.mla_attention`'s docstring).
Nodes several sites share (a mask's token table, the indexer's top-k, the batch size) go through a `Memo`.
"""

from __future__ import annotations

import math
import operator
from typing import Callable

import torch
import torch.fx as fx

from .. import layout
from . import attention_mask as masks
from ._fx import Builder, NoMatch, batch_shape as _shape, same, val as _val
from .attention_match import LatentSource, Site, last_dim_cat_parts

aten = torch.ops.aten


class Memo:
    """Nodes one site emits that later sites reuse (a mask's token table, the indexer's top-k, ...).

    A reuse must see what the reusing site's HF code sees: what those nodes read must not be written between
    where they were emitted and the reusing site. Each entry keeps the graph nodes it read and where it was
    emitted (`commit`: the first node of its site's emission); `Builder.memo_hits` lists the entries a site
    reused, for `attention_checks.check_reads`."""

    def __init__(self):
        self._values, self._reads, self._anchor = {}, {}, {}

    def get(self, b: Builder, key, build: Callable):
        if key in self._values:
            b.memo_hits.append(key)
            return self._values[key]
        mark, hits = len(b.created), len(b.memo_hits)
        value = build()
        new = set(b.created[mark:])
        reads = {a for n in b.created[mark:] for a in n.all_input_nodes if a not in new}
        reads |= {v for v in torch.utils._pytree.tree_leaves(value) if isinstance(v, fx.Node) and v not in new}
        for k in b.memo_hits[hits:]:
            reads |= self._reads[k]
        self._values[key], self._reads[key], self._anchor[key] = value, reads, None
        return value

    def reads_of(self, key) -> tuple:
        return self._anchor[key], self._reads[key]

    def commit(self, first: fx.Node) -> None:
        for k, a in self._anchor.items():
            if a is None:
                self._anchor[k] = first

    def snapshot(self):
        return dict(self._values), dict(self._reads), dict(self._anchor)

    def restore(self, snap) -> None:
        self._values, self._reads, self._anchor = (dict(x) for x in snap)


def _batch(b: Builder, site: Site, memo: Memo):
    """The batch size for emitted shape arguments: an int, or (symbolic batch) a node of q.size(0)."""
    B = _shape(site.q)[0]
    if isinstance(B, int):
        return B
    return memo.get(b, ("batch", str(B)), lambda: b.call(aten.sym_size.int, site.q, 0))


def _times(b: Builder, B, n: int):
    return B * n if isinstance(B, int) else b.call(operator.mul, B, n)


def _lead(B, n: int = 1) -> int:
    """B * n as a reshape size: -1 (inferred) for a symbolic batch."""
    return B * n if isinstance(B, int) else -1


def _valid_of(b: Builder, mask, proof: masks.MaskProof, B, L: int, memo: Memo):
    """bool [B, L] valid-token mask of an attention mask [B|1, 1, 1, L] (None: every token valid)."""

    def build():
        m = proof.build(b)
        if m is not None:
            m = b.call(aten.expand.default, m, [B, 1, 1, L])
            m = b.call(aten.reshape.default, m, [_lead(B), L])
        return m

    return memo.get(b, ("valid", mask), build)



_SCAN_CHUNK = 1024


def _emit_row_cumsum(b: Builder, valid: fx.Node, B, L: int, device) -> fx.Node:
    """int64 [B, L] inclusive cumsum of valid along rows. A long row is scanned in chunks (local scans, then
    the chunk totals), so the scan runs on B * L / chunk programs instead of B (one program per 32K row
    took 37 us of a 1.2 ms HF decode step on the H200)."""
    if L <= _SCAN_CHUNK:
        return b.call(aten.cumsum.default, valid, -1, dtype=torch.int64)
    n = -(-L // _SCAN_CHUNK)
    v = b.call(aten._to_copy.default, valid, dtype=torch.int32)
    if n * _SCAN_CHUNK > L:
        pad = b.call(aten.zeros.default, [B, n * _SCAN_CHUNK - L], dtype=torch.int32, device=device)
        v = b.call(aten.cat.default, [v, pad], 1)
    local = b.call(aten.cumsum.default, b.call(aten.reshape.default, v, [_lead(B), n, _SCAN_CHUNK]), -1,
                   dtype=torch.int32)
    totals = b.call(aten.select.int, local, 2, _SCAN_CHUNK - 1)  # [B, n]
    before = b.call(aten.sub.Tensor, b.call(aten.cumsum.default, totals, -1, dtype=torch.int32), totals)
    cum = b.call(aten.add.Tensor, local, b.call(aten.unsqueeze.default, before, 2))
    cum = b.call(aten.slice.Tensor, b.call(aten.reshape.default, cum, [_lead(B), n * _SCAN_CHUNK]), 1, 0, L)
    return b.call(aten._to_copy.default, cum, dtype=torch.int64)


def _emit_token_table(b: Builder, valid: fx.Node, B, L: int, device):
    """(table int32 [B, L] of valid LOGICAL positions, counts int32 [B]) as aten nodes. The counts are the scan's
    last column, not a row sum: Inductor fused a [B, L] sum with the scatter into one reduction kernel of B
    programs (17.7 us of an 0.85 ms H=16 32K HF step on the H200)."""
    cum = _emit_row_cumsum(b, valid, B, L, device)
    counts = b.call(aten._to_copy.default, b.call(aten.select.int, cum, 1, L - 1), dtype=torch.int32)
    pos = b.call(aten.sub.Tensor, cum, 1)
    dest = b.call(aten.where.ScalarOther, valid, pos, L)
    src = _all_positions(b, B, L, device)
    zeros = b.call(aten.zeros.default, [B, L + 1], dtype=torch.int32, device=device)
    table = b.call(aten.scatter.src, zeros, 1, dest, src)
    table = b.call(aten.slice.Tensor, table, 1, 0, L)
    return table, counts


def _all_positions(b: Builder, B, L: int, device) -> fx.Node:
    """int32 [B, L]: every row lists positions 0 .. L-1."""
    return b.call(aten.expand.default, b.call(aten.arange.default, L, dtype=torch.int32, device=device), [B, L])


def _emit_slots(b: Builder, site: Site, src: LatentSource, B, L: int, memo: Memo):
    """(ckv [N, 1, R], kpe [N, 1, P], ckv_scale, table int32 [B, T], seq_lens int32 [B], empty) for mla.decode: a page
    size 1 view of the latent where table rows list the physical slots of each row's valid tokens. empty:
    bool [B], the rows with no valid token (None where the mask's empty rows need nothing: no mask, or 0 as
    mla.decode gives). With "uniform" empty rows (HF's flat softmax over the whole cache) those rows list all L
    tokens; their query is zeroed by the caller."""
    device = _val(site.q).device
    R, P = _shape(site.latent)[-1], site.rope
    empty_rows = site.proof.empty_rows

    def build():
        valid = _valid_of(b, site.mask, site.proof, B, L, memo)
        if valid is None:  # every token valid: no row is ever empty
            if src.kind != "dcp":
                table = _all_positions(b, B, L, device)
                seq_lens = b.call(aten.full.default, [B], L, dtype=torch.int32, device=device)
                return _physical(b, table, src, B, L, device, memo), seq_lens, None
            valid = b.call(aten.full.default, [B, L], True, dtype=torch.bool, device=device)
            empty_rows_here = masks.EMPTY_ZERO
        else:
            empty_rows_here = empty_rows
        empty = None
        if src.kind == "dcp":
            if empty_rows_here != masks.EMPTY_ZERO:  # emptiness is global: from the whole row, before sharding
                empty = b.call(aten.logical_not.default, b.call(aten.any.dim, valid, -1))
                if empty_rows_here == masks.EMPTY_UNIFORM:
                    valid = b.call(aten.bitwise_or.Tensor, valid, b.call(aten.unsqueeze.default, empty, 1))
            # the valid tokens this rank holds, in local order: a token table over its own shard
            cap = _shape(src.block_table)[1] * _shape(src.ckv)[1]  # local token capacity
            valid = layout.local_mask(valid, L, src.dcp_size, src.dcp_rank, cap, aten=b.aten)  # [B, cap]
            table, seq_lens = _emit_token_table(b, valid, B, cap, device)
            # dcp_decode takes global lengths: ones whose share on this rank is its count (check_lens=False)
            seq_lens = layout.lens_holding(seq_lens, src.dcp_size, aten=b.aten)
        else:
            table, seq_lens = _emit_token_table(b, valid, B, L, device)
            if empty_rows_here != masks.EMPTY_ZERO:
                empty = b.call(aten.eq.Scalar, seq_lens, 0)
                if empty_rows_here == masks.EMPTY_UNIFORM:  # an empty row lists every position
                    table = b.call(aten.where.self, b.call(aten.unsqueeze.default, empty, 1),
                                   _all_positions(b, B, L, device), table)
                    seq_lens = b.call(aten.where.ScalarSelf, empty, L, seq_lens)
        return _physical(b, table, src, B, L, device, memo), seq_lens, empty

    table, seq_lens, empty = memo.get(b, ("slots", src.kind, src.block_table, site.mask, src.dcp_rank), build)
    ckv, kpe, scale = _flat_latent(b, src, B, L, R, P)
    return ckv, kpe, scale, table, seq_lens, empty


def _physical(b: Builder, table: fx.Node, src: LatentSource, B, L: int, device, memo: Memo) -> fx.Node:
    """Logical positions -> physical slots of the flat (page size 1) latent view."""
    if src.kind == "tensor":
        return b.call(aten.add.Tensor, table, _row_base(b, B, L, device, memo))
    return _paged_slots(b, table, src, L)


def _flat_latent(b: Builder, src: LatentSource, B, L: int, R: int, P: int):
    """The latent as a page size 1 cache (ckv [N, 1, R], kpe [N, 1, P], an FP8 ckv's scales [N, 1, R / 128] or
    None); slot = the physical slot."""
    n = _lead(B, L) if src.kind == "tensor" else -1
    ckv = b.call(aten.reshape.default, src.ckv, [n, 1, R])
    # a rope-less latent (P = 0) has no element to infer a -1 from: its slot count, from its own leading dims
    kpe = b.call(aten.reshape.default, src.kpe, [n if P else _slots(b, src.kpe), 1, P])
    scale = None
    if src.ckv_scale is not None:
        scale = b.call(aten.reshape.default, src.ckv_scale, [n, 1, _shape(src.ckv_scale)[-1]])
    return ckv, kpe, scale


def _slots(b: Builder, node: fx.Node):
    """The product of a buffer's leading dims (all but the last) as a reshape size: an int, or a graph value where
    dim 0 (a batch, or a pool sized by one) is symbolic."""
    shape = _shape(node)
    rest = math.prod(shape[1:-1])
    if isinstance(shape[0], int):
        return shape[0] * rest
    return _times(b, b.call(aten.sym_size.int, node, 0), rest)


def _scale_arg(scale) -> tuple:
    """The decode ops' trailing ckv_scale: only for an FP8 latent (a bf16 call keeps its arguments as they were)."""
    return () if scale is None else (scale,)


def _row_base(b: Builder, B, L: int, device, memo: Memo) -> fx.Node:
    """int32 [B, 1]: b * L, the first flat slot of row b in a [B, L, ...] buffer."""

    def build():
        base = b.call(aten.arange.start_step, 0, _times(b, B, L), L, dtype=torch.int32, device=device)
        return b.call(aten.unsqueeze.default, base, 1)

    return memo.get(b, ("row_base", str(B), L), build)


def _emit_sparse_indices(b: Builder, site: Site, src: LatentSource, B, L: int, memo: Memo):
    """(int32 [B, k]: the latent's physical slots of the tokens HF's indexer selects, -1 padded; counts int32 [B]
    of the attention mask A's valid tokens).

    HF: topk(score masked by A, k).indices over the static cache's L positions (invalid ones at -inf or
    + finfo.min), index_mask keeps them, A & ~index_mask drops the invalid ones again: the attended set is
    the top-min(k, count) valid tokens by score. `dsa.indexer_topk` over a page size 1 view of the indexer
    key cache [B, L, Di] -> [B*L, 1, Di], whose block table lists each row's valid tokens (the token table of
    A, slots b*L + t) and seq_lens = their count, returns exactly that set (same score formula: weights are
    HF's weights_proj(x)*Hi^-0.5 in float32, sm_scale HF's softmax_scale). Ties: any choice among equal
    scores (HF's torch.topk does not define one either). Rows with count <= k skip the logits (identity)."""
    sp = site.sparse
    device = _val(site.q).device
    proof = masks.prove_mask(sp.A, additive=site.impl == "eager", dtypes=site.dtypes)
    valid = _valid_of(b, sp.A, proof, B, L, memo)
    if valid is None:
        raise NoMatch("DSA indexer without an attention mask")
    table, counts = memo.get(b, ("table", sp.A), lambda: _emit_token_table(b, valid, B, L, device))

    def indexer():  # a GLM-DSA "shared" layer reuses the previous layer's top-k: one indexer call
        ktable = b.call(aten.add.Tensor, table, _row_base(b, B, L, device, memo))  # indexer slots b*L + t
        _, _, Hi, Di = _shape(sp.q)
        kc = b.call(aten.reshape.default, sp.keys, [_lead(B, L), 1, Di])
        qi = b.call(aten.reshape.default, sp.q, [_lead(B), Hi, Di])
        w = b.call(aten.reshape.default, sp.weights, [_lead(B), Hi])
        return b.call(torch.ops.dsa.indexer_topk.default, qi, w, kc, ktable, counts, sp.k, sp.scale)

    idx = memo.get(b, ("indexer", sp.topk), indexer)
    if src.kind == "tensor":  # the latent [B, 1, L, R] has the same flat slots b*L + t
        return idx, counts

    def paged():  # indexer slot b*L + t -> token t -> block_table[b, t // PS] * PS + t % PS
        keep = b.call(aten.ge.Scalar, idx, 0)
        t = b.call(aten.sub.Tensor, idx, _row_base(b, B, L, device, memo))
        t = b.call(aten.where.ScalarOther, keep, t, 0)
        return b.call(aten.where.ScalarOther, keep, _paged_slots(b, t, src, L), -1)

    return memo.get(b, ("indexer_paged", sp.topk, src.block_table), paged), counts


def _paged_slots(b: Builder, t: fx.Node, src: LatentSource, bound: int | None = None) -> fx.Node:
    """int32 physical slots of logical token positions t [B, K] of a paged latent (`layout.page_slots`). `bound`:
    every t lies in [0, bound) (the positions of a [B, L] mask: L). One page per request that holds them all (a
    [B, 1] block table of pages of >= bound tokens: DSAStaticCache's FP8 layers) makes t // PS = 0 and t % PS = t,
    so the slots are block_table[:, :1] * PS + t: no gather, division or remainder per element (over the HF pass's
    [B, L] token table they made its one reduction kernel 15.9 us a step against 4.8 for a bf16 cache, H100 H 16
    B 8 32K, benchmarks/RESULTS.md 2026-12-06, "Where the FP8 HF step's time goes")."""
    PS = _shape(src.ckv)[1]
    pages = _shape(src.block_table)[1]
    if bound is not None and isinstance(pages, int) and pages == 1 and isinstance(PS, int) and bound <= PS:
        first = b.call(aten.slice.Tensor, src.block_table, 1, 0, 1)
        slot = b.call(aten.add.Tensor, b.call(aten.mul.Tensor, first, PS), t)
    else:
        slot = layout.page_slots(src.block_table, t, PS, aten=b.aten)
    return b.call(aten._to_copy.default, slot, dtype=torch.int32)



def _q_part(b: Builder, q: fx.Node, start: int, width: int) -> fx.Node:
    """q[:, :, 0, start:start + width] as [B, H, width]. When q is a cat on its last dim (HF: cat(q_pass, q_rot))
    and one of its parts is exactly that range, the part itself: nothing then reads the cat, so Inductor need not
    materialize q (a copy kernel per layer) and computes the roped part straight into the decode's input."""
    off = 0
    for part in last_dim_cat_parts(q) or ():
        w = _shape(part)[-1]
        if off == start and w == width and same(_shape(part)[:-1], _shape(q)[:-1]):
            return b.call(aten.select.int, part, 2, 0)
        off += w
    return b.call(aten.slice.Tensor, b.call(aten.select.int, q, 2, 0), 2, start, start + width)


def _absorb_with_kernel(x: torch.Tensor, absorb: str) -> bool:
    """x [B, H, K]: per head, B rows (a symbolic B: never, the kernels' range is a static row count)."""
    if absorb != "auto":
        return absorb == "per_head_linear"
    from .fused_linear import few_token_worth_it

    return few_token_worth_it(x, rows=x.shape[0])


def _per_head_matmul(b: Builder, x: fx.Node, w: fx.Node, contract_last: bool, absorb: str) -> fx.Node:
    """y[b, h] = x[b, h] @ w[h] (w [H, K, N]), or x[b, h] @ w[h]^T with contract_last (w [H, N, K]): [B, H, N]."""
    if _absorb_with_kernel(_val(x), absorb):
        weight = w if contract_last else b.call(aten.transpose.int, w, 1, 2)  # [H, N, K]
        return b.call(torch.ops.mla.per_head_linear.default, x, weight)
    xt = b.call(aten.transpose.int, x, 0, 1)
    y = b.call(aten.bmm.default, xt, b.call(aten.transpose.int, w, 1, 2) if contract_last else w)  # [H, B, N]
    return b.call(aten.transpose.int, y, 0, 1)


def _rows(b: Builder, empty: fx.Node) -> fx.Node:
    """bool [B] -> [B, 1, 1] (broadcast over heads and features)."""
    return b.call(aten.unsqueeze.default, b.call(aten.unsqueeze.default, empty, 1), 2)


def _scale_by_sinks(b: Builder, lat: fx.Node, lse: fx.Node, sinks: fx.Node, empty) -> fx.Node:
    """HF's attention sinks: softmax over [scores | z_h] with the sink's column dropped is softmax(scores) times
    S / (S + e^z) = sigmoid(lse - z) per head (S = sum of e^score, lse = log S, natural log as the ops give it).
    A row with no valid token attends only the sink: 0 (lse -inf gives it, except where such a row was given a flat
    softmax over every slot: `empty`, which is then zeroed)."""
    keep = b.call(aten.sigmoid.default, b.call(aten.sub.Tensor, lse, sinks))  # [B, H]
    if empty is not None:
        keep = b.call(aten.where.ScalarSelf, b.call(aten.unsqueeze.default, empty, 1), 0.0, keep)
    scaled = b.call(aten.mul.Tensor, lat, b.call(aten.unsqueeze.default, keep, 2))
    if _val(scaled).dtype == _val(lat).dtype:
        return scaled
    return b.call(aten._to_copy.default, scaled, dtype=_val(lat).dtype)


def emit(b: Builder, site: Site, src: LatentSource, memo: Memo, absorb: str = "auto") -> fx.Node:
    """The absorbed computation; returns the node replacing the attention output [B, H, 1, v]. absorb: how the
    per-head projections are written (`tuning.Tuning.absorb`)."""
    H = site.heads
    B = _batch(b, site, memo)  # for shape arguments: int or a node
    L, R = _shape(site.latent)[-2:]
    nope, v_dim, P = site.nope, site.v_dim, site.rope
    empty_rows = site.proof.empty_rows
    # q_pe and q_abs stay strided views (last dim contiguous): the decode ops take any batch/head strides, so no
    # copy kernels before the attention
    q_nope = _q_part(b, site.q, site.nope_offset, nope)
    q_pe = _q_part(b, site.q, site.rope_offset, P)
    w = b.call(aten.reshape.default, site.weight, [H, nope + v_dim, R])
    w_uk = b.call(aten.slice.Tensor, w, 1, 0, nope)  # [H, nope, R]
    w_uv = b.call(aten.slice.Tensor, w, 1, nope, nope + v_dim)  # [H, v, R]
    q_abs = _per_head_matmul(b, q_nope, w_uk, contract_last=False, absorb=absorb)  # [B, H, R]
    if site.sparse is not None and src.kind == "dcp":  # DSA under DCP: the indexer over each rank's key shard
        res, empty = site.sparse.shard.emit(b, site, src, q_abs, q_pe, B, L, memo)  # `passes.dsa_dcp`
        lat = b.item(res, 0)
    elif site.sparse is not None:  # DSA sparse graph: HF's indexer -> dsa.indexer_topk, attention over its slots
        idx, counts = _emit_sparse_indices(b, site, src, B, L, memo)
        ckv, kpe, scale = _flat_latent(b, src, B, L, R, P)
        res = b.call(torch.ops.mla.sparse_decode.default, q_abs, q_pe, ckv, kpe, idx, site.scale, *_scale_arg(scale))
        lat = b.item(res, 0)  # [B, H, R]
        empty = None if empty_rows == masks.EMPTY_ZERO else b.call(aten.eq.Scalar, counts, 0)
        if empty_rows == masks.EMPTY_UNIFORM:
            # HF: every score of an empty row rounds to the mask constant, so it attends all L positions alike;
            # the k-wide sparse op cannot list them: a second decode over every slot, with zero queries (scores 0)
            # and length L on the empty rows only (0 elsewhere: nothing to read)
            device = _val(site.q).device
            table = memo.get(b, ("all_slots", src.kind, src.block_table),
                             lambda: _physical(b, _all_positions(b, B, L, device), src, B, L, device, memo))
            lens = b.call(aten._to_copy.default, b.call(aten.where.Scalar, empty, L, 0), dtype=torch.int32)
            flat = b.call(torch.ops.mla.decode.default, b.call(aten.zeros_like.default, q_abs),
                          b.call(aten.zeros_like.default, q_pe), ckv, kpe, table, lens, site.scale, *_scale_arg(scale))
            lat = b.call(aten.where.self, _rows(b, empty), b.item(flat, 0), lat)
    else:
        ckv, kpe, scale, table, seq_lens, empty = _emit_slots(b, site, src, B, L, memo)
        if empty is not None and empty_rows == masks.EMPTY_UNIFORM:
            # an empty row lists every slot; a zero query gives each score 0: HF's flat softmax over the cache
            rows = _rows(b, empty)
            q_abs = b.call(aten.where.ScalarSelf, rows, 0.0, q_abs)
            q_pe = b.call(aten.where.ScalarSelf, rows, 0.0, q_pe)
        if src.kind == "dcp":
            # check_lens=False: these seq_lens are this rank's own token count times n, not lengths shared by
            # every rank, so dcp_decode must not compare them across ranks (shapes still are)
            # heads split over the group (TP x DCP): each rank's q holds its own heads -> mla.tp_dcp_decode
            op = torch.ops.mla.tp_dcp_decode.default if src.heads_sharded else torch.ops.mla.dcp_decode.default
            res = b.call(op, q_abs, q_pe, ckv, kpe, table, seq_lens, site.scale, src.dcp_size, src.dcp_rank,
                         src.group_name, False, *_scale_arg(scale))
        else:
            res = b.call(torch.ops.mla.decode.default, q_abs, q_pe, ckv, kpe, table, seq_lens, site.scale,
                         *_scale_arg(scale))
        lat = b.item(res, 0)  # [B, H, R]
    if site.sinks is not None:
        lat = _scale_by_sinks(b, lat, b.item(res, 1), site.sinks, empty)
    elif empty is not None and empty_rows == masks.EMPTY_NAN:  # HF: softmax of a row of -inf
        lat = b.call(aten.where.ScalarSelf, _rows(b, empty), float("nan"), lat)
    out = _per_head_matmul(b, lat, w_uv, contract_last=True, absorb=absorb)  # [B, H, v]
    return b.call(aten.unsqueeze.default, out, 2)  # [B, H, 1, v]
