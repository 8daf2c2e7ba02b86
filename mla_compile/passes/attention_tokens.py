"""The attention rewrite for steps with S = 2 .. MAX_QUERY_TOKENS query tokens per request (MTP heads, HF's
assisted generation and prompt lookup verifying drafted tokens): the proof that the step's mask fits
`mla.decode`'s multi-token contract, and the emission.

The contract (ops/attention.py): q [B, S, H, *] over ONE token table per request, and per-query-token limits
seq_lens int32 [B, S] (non-decreasing in j): query token j attends the first seq_lens[b, j] entries of row b's
table. A mask [B|1, 1, S, L] fits it when every query row's valid tokens are a prefix, in position order, of the
last row's: then the table lists the last row's valid tokens in position order and limits[b, j] = the count of
row j's valid tokens (a sum on the device, no host sync).

`prove_rows` proves that from the graph: the mask's boolean condition (SDPA's bool `attn_mask`, or the `cond`
of eager's `where(cond, 0, finfo.min)`) must be a conjunction whose terms are each
- row-independent: size 1 along the query dim (the same for every query token: HF's padding mask
  `attention_mask[batch_idx, kv_idx]`, the `new_ones(())` HF starts from), or
- causal: `kv <= q` (`le(kv, q)` / `ge(q, kv)`) with kv = arange(L) + k0 along the key dim (k0 an int) and
  q = arange(S) + c along the query dim (c anything the graph holds: HF 5.24 reads the cache's
  `cumulative_length`).
Then row j = A & (t + k0 <= c + j): rows nested by position, each a position prefix of row S - 1, limits
non-decreasing. Any other mask (a graph-input 4-D mask: generate()'s precomputed one; HF's cache_position as
q; a per-query-token DSA top-k mask) cannot be proven: the site stays unchanged (counted, logged; building the
mask in the graph, `optimize_generate` / `create_masks_in_graph`, makes it provable).

Rows with no valid token (a query token at a padding position): SDPA gives 0, as the op (limit 0). Eager gives
HF's flat softmax over all L positions (`finfo.min`) or NaN (-inf): a second `mla.decode` with zero queries over
every slot on those rows only (S folded into the batch: length L there, 0 elsewhere), or NaN, as for one token.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .. import layout
from . import attention_emit as E
from . import attention_mask as masks
from ._fx import Builder, NoMatch, batch_shape as _shape, val
from .attention_match import LatentSource, Site

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------------ emission
def _tokens_first(b: Builder, x: fx.Node, start: int, width: int) -> fx.Node:
    """q [B, H, S, D] -> q[..., start:start + width] as [B, S, H, width] (a strided view)."""
    x = b.call(aten.slice.Tensor, x, 3, start, start + width)
    return b.call(aten.transpose.int, x, 1, 2)


def _rows(b: Builder, site: Site, B, S: int, L: int, memo: E.Memo):
    """(valid bool [B, S, L]: each query token's valid tokens; last bool [B, L]: the last token's)."""

    def build():
        m = site.proof.build(b)
        if m is None:
            raise NoMatch("multi-token mask without a condition")
        m = b.call(aten.reshape.default, b.call(aten.expand.default, m, [B, 1, S, L]), [E._lead(B), S, L])
        return m, b.call(aten.select.int, m, 1, S - 1)

    return memo.get(b, ("token_rows", site.mask, S), build)


def _count(b: Builder, valid: fx.Node) -> fx.Node:
    """int32 row sums of a bool / int mask."""
    return b.call(aten._to_copy.default, b.call(aten.sum.dim_IntList, valid, [-1]), dtype=torch.int32)


def _table(b: Builder, site: Site, src: LatentSource, B, S: int, L: int, memo: E.Memo):
    """(table int32 [B, T] of physical slots of the last row's valid tokens, limits int32 [B, S], empty bool
    [B, S]: rows with no valid token): the multi-token contract, this rank's share of it for DCP."""
    device = val(site.q).device

    def build():
        valid, last = _rows(b, site, B, S, L, memo)
        empty = b.call(aten.eq.Scalar, _count(b, valid), 0)  # global: before sharding
        if src.kind == "dcp":
            n, r = src.dcp_size, src.dcp_rank
            cap = _shape(src.block_table)[1] * _shape(src.ckv)[1]
            last = layout.local_mask(last, L, n, r, cap, aten=b.aten)
            # each row's count of the tokens this rank holds (t % n == r, t < cap * n: what layout.local_mask keeps),
            # as a sum against an int32 ownership row rather than over local_mask's padded copy of the rows: a sum
            # over a padded row (bool, or int32 whose bool source is itself padded: HF's mask of a compiled prefill
            # shorter than the cache) made Inductor's CPU vectorizer emit C++ that does not compile (VecMask<long>
            # ?: VecMask<float>, torch 2.13)
            t = b.call(aten.arange.default, L, dtype=torch.int32, device=device)
            own = b.call(aten.logical_and.default, b.call(aten.eq.Scalar, b.call(aten.remainder.Scalar, t, n), r),
                         b.call(aten.lt.Scalar, t, cap * n))
            own = b.call(aten._to_copy.default, own, dtype=torch.int32)
            per_row = b.call(aten.mul.Tensor, b.call(aten._to_copy.default, valid, dtype=torch.int32), own)
            limits = _count(b, per_row)  # [B, S]
            table, _ = E._emit_token_table(b, last, B, cap, device)
            # dcp_decode takes GLOBAL per-token limits: ones whose share on this rank is its count
            limits = layout.lens_holding(limits, n, aten=b.aten)
        else:
            limits = _count(b, valid)
            table, _ = E._emit_token_table(b, last, B, L, device)
        return E._physical(b, table, src, B, L, device, memo), limits, empty

    return memo.get(b, ("token_table", src.kind, src.block_table, site.mask, src.dcp_rank, S), build)


def _attend(b: Builder, src: LatentSource, q_abs, q_pe, ckv, kpe, table, lens, scale, ckv_scale=None):
    """ckv_scale: an FP8 latent's scales (None for a bf16 cache, whose calls keep their arguments as they were)."""
    if src.kind == "dcp":
        # heads split over the group (TP x DCP): mla.tp_dcp_decode takes the same arguments, [B, S] limits included
        op = torch.ops.mla.tp_dcp_decode.default if src.heads_sharded else torch.ops.mla.dcp_decode.default
        return b.call(op, q_abs, q_pe, ckv, kpe, table, lens, scale, src.dcp_size, src.dcp_rank, src.group_name,
                      False, *E._scale_arg(ckv_scale))
    return b.call(torch.ops.mla.decode.default, q_abs, q_pe, ckv, kpe, table, lens, scale, *E._scale_arg(ckv_scale))


def _flat_rows(b: Builder, site: Site, src: LatentSource, B, S: int, L: int, empty, ckv, kpe, ckv_scale, q_abs,
               q_pe, memo: E.Memo) -> fx.Node:
    """HF eager's flat softmax over all L positions for the rows in `empty` [B, S] (every score of such a row
    rounds to the mask constant): one decode with zero queries, S folded into the batch, every slot listed on
    those rows and none elsewhere. Returns lat [B, S, H, R]."""
    device = val(site.q).device
    BS, H, R = E._lead(B, S), site.heads, _shape(site.latent)[-1]

    def build():
        if src.kind == "dcp":
            n, r = src.dcp_size, src.dcp_rank
            cap = _shape(src.block_table)[1] * _shape(src.ckv)[1]
            every = b.call(aten.full.default, [B, L], True, dtype=torch.bool, device=device)
            every = layout.local_mask(every, L, n, r, cap, aten=b.aten)
            table, count = E._emit_token_table(b, every, B, cap, device)
            table, width = E._physical(b, table, src, B, L, device, memo), cap
            count = layout.lens_holding(count, n, aten=b.aten)
        else:
            table, width = E._physical(b, E._all_positions(b, B, L, device), src, B, L, device, memo), L
            count = b.call(aten.full.default, [B], L, dtype=torch.int32, device=device)
        table = b.call(aten.reshape.default, b.call(aten.expand.default, b.call(aten.unsqueeze.default, table, 1),
                                                    [B, S, width]), [BS, width])
        count = b.call(aten.expand.default, b.call(aten.unsqueeze.default, count, 1), [B, S])
        lens = b.call(aten.where.ScalarOther, empty, count, 0)
        return table, b.call(aten._to_copy.default, b.call(aten.reshape.default, lens, [BS]), dtype=torch.int32)

    table, lens = memo.get(b, ("flat_rows", src.kind, src.block_table, site.mask, src.dcp_rank, S), build)
    zq = b.call(aten.zeros.default, [BS, H, R], dtype=val(q_abs).dtype, device=device)
    zp = b.call(aten.zeros.default, [BS, H, site.rope], dtype=val(q_pe).dtype, device=device)
    flat = b.item(_attend(b, src, zq, zp, ckv, kpe, table, lens, site.scale, ckv_scale), 0)
    return b.call(aten.reshape.default, flat, [E._lead(B), S, H, R])


def absorbed_queries(b: Builder, site: Site, memo: E.Memo, absorb: str):
    """The S-token site's queries absorbed: (B, L, R, q_abs [B*S, H, R] = q_nope·W_UK, q_pe [B, S, H, P], W_UV
    [H, v, R]); the emitters of S-token steps (here and `dsa_tokens`) start from it."""
    H, S = site.heads, site.tokens
    B = E._batch(b, site, memo)
    L, R = _shape(site.latent)[-2:]
    nope, v_dim = site.nope, site.v_dim
    q_nope = _tokens_first(b, site.q, site.nope_offset, nope)  # [B, S, H, nope]
    q_pe = _tokens_first(b, site.q, site.rope_offset, site.rope)  # [B, S, H, P]
    w = b.call(aten.reshape.default, site.weight, [H, nope + v_dim, R])
    w_uk = b.call(aten.slice.Tensor, w, 1, 0, nope)
    w_uv = b.call(aten.slice.Tensor, w, 1, nope, nope + v_dim)
    folded = b.call(aten.reshape.default, q_nope, [E._lead(B, S), H, nope])  # the absorption takes rows [N, H, K]
    q_abs = E._per_head_matmul(b, folded, w_uk, contract_last=False, absorb=absorb)
    return B, L, R, q_abs, q_pe, w_uv


def project(b: Builder, site: Site, lat, w_uv, B, absorb: str) -> fx.Node:
    """lat [B*S, H, R] -> ·W_UV^T -> the attention output [B, H, S, v]."""
    out = E._per_head_matmul(b, lat, w_uv, contract_last=True, absorb=absorb)  # [B*S, H, v]
    out = b.call(aten.reshape.default, out, [E._lead(B), site.tokens, site.heads, site.v_dim])
    return b.call(aten.transpose.int, out, 1, 2)


def scale_by_sinks(b: Builder, site: Site, lat, lse, empty, B) -> fx.Node:
    """HF's attention sinks on an S-token site (`attention_emit._scale_by_sinks` with S folded into the batch): lat
    [B, S, H, R] and lse [B, S, H] of the decode, empty bool [B, S] (rows with no valid token) -> lat [B*S, H, R]
    scaled by sigmoid(lse - z_h); a row with no valid token attends only its sink: 0, whatever HF's mask constant
    (the sink's logit beats finfo.min and -inf alike)."""
    H, S, R = site.heads, site.tokens, _shape(lat)[-1]
    BS = E._lead(B, S)
    lat = b.call(aten.reshape.default, lat, [BS, H, R])
    lse = b.call(aten.reshape.default, lse, [BS, H])
    return E._scale_by_sinks(b, lat, lse, site.sinks, b.call(aten.reshape.default, empty, [BS]))


def emit_tokens(b: Builder, site: Site, src: LatentSource, memo: E.Memo, absorb: str = "auto") -> fx.Node:
    """The absorbed computation of a site with S > 1 query tokens; returns the node replacing the attention
    output [B, H, S, v]."""
    H, S = site.heads, site.tokens
    B, L, R, q_abs, q_pe, w_uv = absorbed_queries(b, site, memo, absorb)
    P = site.rope
    q_abs = b.call(aten.reshape.default, q_abs, [E._lead(B), S, H, R])
    table, limits, empty = _table(b, site, src, B, S, L, memo)
    ckv, kpe, ckv_scale = E._flat_latent(b, src, B, L, R, P)
    res = _attend(b, src, q_abs, q_pe, ckv, kpe, table, limits, site.scale, ckv_scale)
    lat = b.item(res, 0)  # [B, S, H, R]
    if site.sinks is not None:
        return project(b, site, scale_by_sinks(b, site, lat, b.item(res, 1), empty, B), w_uv, B, absorb)
    rows = b.call(aten.unsqueeze.default, b.call(aten.unsqueeze.default, empty, 2), 3)  # [B, S, 1, 1]
    if site.proof.empty_rows == masks.EMPTY_UNIFORM:
        flat = _flat_rows(b, site, src, B, S, L, empty, ckv, kpe, ckv_scale, q_abs, q_pe, memo)
        lat = b.call(aten.where.self, rows, flat, lat)
    elif site.proof.empty_rows == masks.EMPTY_NAN:
        lat = b.call(aten.where.ScalarSelf, rows, float("nan"), lat)
    return project(b, site, b.call(aten.reshape.default, lat, [E._lead(B, S), H, R]), w_uv, B, absorb)
