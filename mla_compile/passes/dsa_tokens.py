"""DSA sparse steps with S = 2 .. MAX_QUERY_TOKENS query tokens per request (speculative verification, MTP heads on
V3.2 / GLM-DSA): HF's per-query-token indexer -> `dsa.indexer_topk` over one row per query token, the attention ->
`mla.sparse_decode` with indices [B, S, K].

HF (transformers 5.24, `DeepseekV32Indexer` / `GlmMoeDsaIndexer`) with S query tokens: scores [B, S, L] (query token
j's weights . relu(q_j . keys^T * s)), each row masked by its own row of the attention mask A [B, 1, S, L]
(`A[:, 0]`: causal AND padding), `topk(k)` per row, I = ones.scatter(-1, idx, False).unsqueeze(1) [B, 1, S, L],
attention over `A & ~I` (or `A.masked_fill(I, min)`). So query token j attends the top-min(k, count_j) of ITS valid
tokens (count_j = row j's count in A), ranked by its own scores: the S = 1 argument (`dsa_indexer`) row by row.
`dsa_indexer.match_sparse_indexer` proves the formula and those shapes.

Why not the op's 4-D form: `dsa.indexer_topk(q [B, S, Hi, Di], ...)` takes ONE table and length per request and lets
query token j see the first `len - S + 1 + j` entries. HF's row j sees count_j tokens; the two agree only when the
query tokens' own positions are all valid in A (no padding among the S new tokens), a property of the mask's
values that no graph proves (`tests/hf/test_hf_multi_token.py` has a step whose first query token is padding). So
each query token becomes a request of its own, which is what the 4-D op does inside (`ops/dsa.per_query_token`):
q [B*S, Hi, Di], weights [B*S, Hi], row b*S + j's token table = A's row j's valid tokens (+ b*L: indexer slots of
the keys viewed as [B*L, 1, Di]) and its count. Exact for any hard A (no prefix proof needed: nothing is shared
between the rows). The attention then takes the [B, S, K] form (each query token its own index list).

Rows with no valid token: SDPA's bool mask gives 0 (the op's empty row); eager gives HF's flat softmax over all L
positions (finfo.min: a second `mla.decode` with zero queries over every slot on those rows) or NaN (-inf).
DCP: the same rows over each rank's key shard (`dsa_tokens_dcp`). Anything unproven keeps HF's site (counted).
"""

from __future__ import annotations

import torch
import torch.fx as fx

from . import attention_emit as E
from . import attention_tokens as T
from . import dsa_dcp, dsa_tokens_dcp
from . import attention_mask as masks
from .dsa_indexer import NotSparse
from ._fx import Builder, NoMatch, batch_shape as _shape, val
from .attention_match import LatentSource, Site

aten = torch.ops.aten


def check(site: Site, sp, src: LatentSource) -> None:
    """NoMatch (a `dsa_indexer.NotSparse`) unless the indexer `sp` serves this S-token site."""
    if sp.tokens != site.tokens:
        raise NotSparse(f"indexer over {sp.tokens} query token(s), attention over {site.tokens}")
    if src.kind == "dcp":  # the indexer keys must be our cache's shard beside the latent's (`dsa_dcp.key_shard`)
        if site.sinks is not None:  # dsa_tokens_dcp merges the ranks' states into lat alone: no lse to scale by
            raise NotSparse(f"attention sinks with {site.tokens} query tokens per request under DCP")
        sp.shard = dsa_dcp.key_shard(sp.keys, src)
        sp.nodes |= sp.shard.nodes  # where HF reads the key pages (for check_reads)
    elif src.kind not in ("tensor", "paged"):
        raise NotSparse(f"{site.tokens} query tokens per request over a {src.kind} latent")


def _valid_rows(b: Builder, site: Site, B, S: int, L: int, memo: E.Memo) -> fx.Node:
    """valid bool [B*S, L]: A's row j of request b at row b*S + j."""
    sp = site.sparse

    def build():
        proof = masks.prove_mask(sp.A, additive=site.impl == "eager", dtypes=site.dtypes)
        m = proof.build(b)
        if m is None:
            raise NoMatch("DSA indexer without an attention mask")
        return b.call(aten.reshape.default, b.call(aten.expand.default, m, [B, 1, S, L]), [E._lead(B, S), L])

    return memo.get(b, ("dsa_valid_rows", sp.A, S), build)


def _query_rows(b: Builder, site: Site, B, S: int, L: int, memo: E.Memo):
    """(the rows' token table int32 [B*S, L] of logical positions, counts int32 [B*S])."""
    return memo.get(b, ("dsa_query_rows", site.sparse.A, S), lambda: E._emit_token_table(
        b, _valid_rows(b, site, B, S, L, memo), E._times(b, B, S), L, val(site.q).device))


def _indices(b: Builder, site: Site, src: LatentSource, B, S: int, L: int, memo: E.Memo):
    """(int32 [B, S, k]: the latent's physical slots each query token's indexer selects, -1 padded; counts int32
    [B, S] of A's valid tokens per query token)."""
    sp = site.sparse
    device = val(site.q).device
    table, counts = _query_rows(b, site, B, S, L, memo)

    def row_base():  # request b's first indexer slot b*L, repeated for its S query rows: [B*S, 1]
        base = b.call(aten.expand.default, b.call(aten.unsqueeze.default, E._row_base(b, B, L, device, memo), 1),
                      [B, S, 1])
        return b.call(aten.reshape.default, base, [E._lead(B, S), 1])

    base = memo.get(b, ("row_base_tokens", str(B), L, S), row_base)

    def indexer():  # a GLM-DSA "shared" layer reuses the previous layer's top-k: one indexer call
        _, _, Hi, Di = _shape(sp.q)
        kc = b.call(aten.reshape.default, sp.keys, [E._lead(B, L), 1, Di])
        qi = b.call(aten.reshape.default, sp.q, [E._lead(B, S), Hi, Di])
        w = b.call(aten.reshape.default, sp.weights, [E._lead(B, S), Hi])
        ktable = b.call(aten.add.Tensor, table, base)
        return b.call(torch.ops.dsa.indexer_topk.default, qi, w, kc, ktable, counts, sp.k, sp.scale)

    idx = memo.get(b, ("indexer_tokens", sp.topk), indexer)  # [B*S, k]: indexer slots b*L + t
    if src.kind == "paged":  # -> token t -> block_table[b, t // PS] * PS + t % PS
        def paged():
            keep = b.call(aten.ge.Scalar, idx, 0)
            t = b.call(aten.where.ScalarOther, keep, b.call(aten.sub.Tensor, idx, base), 0)
            t = b.call(aten.reshape.default, t, [E._lead(B), S * sp.k])  # request b's rows: one block-table row
            slots = b.call(aten.reshape.default, E._paged_slots(b, t, src), [E._lead(B, S), sp.k])
            return b.call(aten.where.ScalarOther, keep, slots, -1)

        idx = memo.get(b, ("indexer_tokens_paged", sp.topk, src.block_table), paged)
    idx = b.call(aten.reshape.default, idx, [E._lead(B), S, sp.k])
    return idx, b.call(aten.reshape.default, counts, [E._lead(B), S])


def _flat_rows(b: Builder, site: Site, src: LatentSource, B, S: int, L: int, empty, ckv, kpe, ckv_scale, like,
               memo: E.Memo):
    """lat [B, S, H, R] of HF eager's flat softmax over all L positions on the rows in `empty` [B, S]: one decode
    with zero queries, S folded into the batch, every slot on those rows, none elsewhere."""
    device = val(site.q).device
    BS, H = E._lead(B, S), site.heads
    table = E._physical(b, E._all_positions(b, B, L, device), src, B, L, device, memo)  # [B, L]
    table = b.call(aten.reshape.default, b.call(aten.expand.default, b.call(aten.unsqueeze.default, table, 1),
                                                [B, S, L]), [BS, L])
    lens = b.call(aten._to_copy.default, b.call(aten.reshape.default, b.call(aten.where.Scalar, empty, L, 0), [BS]),
                  dtype=torch.int32)
    R = _shape(site.latent)[-1]
    zq = b.call(aten.zeros.default, [E._times(b, B, S), H, R], dtype=val(like).dtype, device=device)
    zp = b.call(aten.zeros.default, [E._times(b, B, S), H, site.rope], dtype=val(like).dtype, device=device)
    flat = b.call(torch.ops.mla.decode.default, zq, zp, ckv, kpe, table, lens, site.scale, *E._scale_arg(ckv_scale))
    return b.call(aten.reshape.default, b.item(flat, 0), [E._lead(B), S, H, R])


def emit_sparse_tokens(b: Builder, site: Site, src: LatentSource, memo: E.Memo, absorb: str = "auto") -> fx.Node:
    """The absorbed DSA sparse computation of a site with S > 1 query tokens; returns the node replacing the
    attention output [B, H, S, v]."""
    H, S, P = site.heads, site.tokens, site.rope
    B, L, R, q_abs, q_pe, w_uv = T.absorbed_queries(b, site, memo, absorb)
    if src.kind == "dcp":  # each rank's key shard: `dsa_tokens_dcp`
        q_pe = b.call(aten.reshape.default, q_pe, [E._lead(B, S), H, P])
        lat = dsa_tokens_dcp.emit(b, site, src, q_abs, q_pe, _valid_rows(b, site, B, S, L, memo), B, S, L, memo)
        return T.project(b, site, lat, w_uv, B, absorb)
    q_abs = b.call(aten.reshape.default, q_abs, [E._lead(B), S, H, R])
    idx, counts = _indices(b, site, src, B, S, L, memo)
    ckv, kpe, ckv_scale = E._flat_latent(b, src, B, L, R, P)
    res = b.call(torch.ops.mla.sparse_decode.default, q_abs, q_pe, ckv, kpe, idx, site.scale,
                 *E._scale_arg(ckv_scale))
    lat = b.item(res, 0)  # [B, S, H, R]; a row with no valid slot gives 0 (SDPA's bool mask gives the same)
    if site.sinks is not None:
        empty = b.call(aten.eq.Scalar, counts, 0)  # [B, S]
        return T.project(b, site, T.scale_by_sinks(b, site, lat, b.item(res, 1), empty, B), w_uv, B, absorb)
    empty_rows = site.proof.empty_rows
    if empty_rows != masks.EMPTY_ZERO:
        empty = b.call(aten.eq.Scalar, counts, 0)  # [B, S]
        rows = b.call(aten.unsqueeze.default, b.call(aten.unsqueeze.default, empty, 2), 3)  # [B, S, 1, 1]
        if empty_rows == masks.EMPTY_UNIFORM:
            lat = b.call(aten.where.self, rows, _flat_rows(b, site, src, B, S, L, empty, ckv, kpe, ckv_scale, q_abs,
                                                  memo), lat)
        else:  # EMPTY_NAN: HF's softmax of a row of -inf
            lat = b.call(aten.where.ScalarSelf, rows, float("nan"), lat)
    return T.project(b, site, b.call(aten.reshape.default, lat, [E._lead(B, S), H, R]), w_uv, B, absorb)

