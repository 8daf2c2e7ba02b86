"""`dsa::dcp_indexer_topk`: the DSA indexer over a DCP-sharded indexer key cache, an exact global top-k.

Each rank of an n-rank DCP group holds the token-cyclic shard of every request's indexer keys (token t on rank
t % n at local position t // n, `mla_compile.layout`), in pages addressed like its latent shard. One call on
rank r:

    local    = layout.local_lens(seq_lens, n, r)                  GLOBAL lengths in, this shard's lengths
    cand     = dsa::dcp_local_candidates(q, weights, this shard, local, topk, sm_scale, n, r)
                                                                   int64 [B, topk]: this rank's best candidates,
                                                                   top_keys(order_keys(score, i * n + r), topk)
                                                                   (CUDA: the logits kernel + the radix select)
    gathered = all_gather(cand as int32 pairs + trailer)           [n, B, topk]  ONE collective, no key cache moved
    win      = top_keys(gathered as [B, n * topk], topk)           the global top-k, identical on every rank
    out      = this rank's physical slots of the winners it owns   int32 [B, topk], -1 after

Exact: the order (score descending, then lower global token index: `mla_compile.topk_order`) is total, so each
token of the global top-k is in its own rank's local top-k, and the top-k of the union of the local top-k's is the
global one. Each int64 key carries a (score, token) pair, so the collective moves B * topk * 8 bytes per rank.
The tie key of local table position i is i * n + r: the global token index when the block table lists the rank's
tokens from local position 0 (every cache does). A caller that hands a compacted token table (the attention pass:
only the mask's valid tokens) gets ties broken by (table position, rank) instead.

Registration: CompositeImplicitAutograd with `_c10d_functional` collectives (as `mla::dcp_decode`): one Dynamo
node, decomposed by AOTAutograd into `dsa::dcp_local_candidates` (an op of its own: kernels on CUDA),
`all_gather_into_tensor`, `wait_tensor` and the selection ops; no host sync, so CUDA graphs can capture it.
dcp_size 1 is `dsa::indexer_topk` (the same set).
Cross-rank consistency as `mla::dcp_decode` (`dcp_consistency`, op 3): shapes, topk, sm_scale and (check_lens)
seq_lens are compared on the call's gather: a ValueError on every rank where checks read values; elsewhere the
rows of disagreeing requests select nothing (-1: their attention then gives (0, -inf)).
"""

from __future__ import annotations

import torch

from .. import layout, topk_order
from . import _checks as C
from . import dcp_consistency as agree
from .attention import token_slots
from .dcp import check_group_args, check_rank_args
from ._plans import Plans, dispatch_plan
from ._registry import define
from .dsa import check_indexer_args, slot_scores

torch.library.define(
    "dsa::dcp_indexer_topk",
    "(Tensor q, Tensor weights, Tensor k_cache, Tensor block_table, Tensor seq_lens, int topk, float sm_scale, "
    "int dcp_size, int dcp_rank, str group_name, bool check_lens=True) -> Tensor",
)


def check_dcp_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale, dcp_size, dcp_rank,
                           group_name, check_lens) -> None:
    """The group's arguments, one query token (q [B, Hi, Di]), GLOBAL seq_lens >= 0, and `dsa::indexer_topk`'s
    checks with this rank's local lengths (which must fit this rank's block table)."""
    check_group_args(dcp_size, dcp_rank, group_name)
    C.check(isinstance(check_lens, bool), "check_lens", f"must be a bool, got {check_lens!r}")
    C.check(isinstance(q, torch.Tensor) and q.dim() == 3, "q",
            f"must be [B, Hi, Di] (one query token per request), got {getattr(q, 'shape', type(q).__name__)}")
    C.check_tensor(seq_lens, "seq_lens", 1, torch.int32)
    if not C.is_fake(seq_lens) and C.data_checks_enabled(seq_lens.device) and seq_lens.numel():
        C.check(int(seq_lens.min()) >= 0, "seq_lens", f"lengths must be >= 0, got {int(seq_lens.min())}")
    check_indexer_args(q, weights, k_cache, block_table, layout.local_lens(seq_lens, dcp_size, dcp_rank), topk,
                       sm_scale)


@C.once_per_signature
def check_local_candidates_args(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank):
    """`dsa::indexer_topk`'s checks with this shard's lengths, q [B, Hi, Di], dcp_size / dcp_rank in range, and every
    global token index of the table (position * dcp_size + dcp_rank) below 2^32 (the order key's index half)."""
    check_rank_args(dcp_size, dcp_rank)
    C.check(isinstance(q, torch.Tensor) and q.dim() == 3, "q",
            f"must be [B, Hi, Di] (one query token per request), got {getattr(q, 'shape', type(q).__name__)}")
    check_indexer_args(q, weights, k_cache, block_table, local_lens, topk, sm_scale, lens="local_lens")
    T = block_table.shape[1] * k_cache.shape[1]
    C.check(T * dcp_size <= 2**32, "block_table", f"capacity {T} x dcp_size {dcp_size} tokens exceeds the order "
            "key's 2^32 token indices")


@define(
    "dsa::dcp_local_candidates",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor q, Tensor weights, Tensor k_cache, Tensor block_table, Tensor local_lens, int topk, "
           "float sm_scale, int dcp_size, int dcp_rank) -> Tensor",
)
def dcp_local_candidates(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank):
    """A DCP rank's indexer candidates: its shard's top-k (score, global token) pairs as order keys.

    Shapes: q [B, Hi, Di], weights float32 [B, Hi], k_cache [NP, PS, Di] and block_table int32 [B, MP]: this rank's
    shard of the indexer keys, local_lens int32 [B]: this shard's lengths (`layout.local_lens`). Table position i
    holds global token i * dcp_size + dcp_rank. Returns int64 [B, topk]: the `topk_order` keys of the shard's
    top-min(topk, local_len) tokens, largest first, then NONE. Every row is scored (a short shard still offers all
    of its tokens to the global top-k); the score is `dsa::indexer_topk`'s."""
    check_local_candidates_args(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank)
    return local_candidates(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank)


@dcp_local_candidates.register_fake
def _(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank):
    check_local_candidates_args(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank)
    return q.new_empty((q.shape[0], topk), dtype=torch.int64)


_CANDIDATE_PLANS = Plans()
_make_candidates_plan = dispatch_plan("dcp_local_candidates_plan")


@dcp_local_candidates.register_kernel("cuda")
def _(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank):
    return _CANDIDATE_PLANS.run((q, weights, k_cache, block_table, local_lens), (topk, sm_scale, dcp_size, dcp_rank),
                                check_local_candidates_args, _make_candidates_plan,
                                (q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank))


def local_candidates(q, weights, k_cache, block_table, local_lens, topk: int, sm_scale: float, dcp_size: int,
                     dcp_rank: int) -> torch.Tensor:
    """int64 [B, topk]: this rank's top-k keys (`topk_order`), NONE-padded; table position i is token i * n + r.
    The definition (plain torch): `dsa::dcp_local_candidates`'s CPU impl."""
    PS = k_cache.shape[1]
    T = block_table.shape[1] * PS  # static: the table's capacity (no host read of the lengths)
    cols = torch.arange(T, device=q.device)
    slots = token_slots(block_table, PS, T)
    valid = cols[None, :] < local_lens.long()[:, None]
    score = slot_scores(q, weights, k_cache, slots, valid, sm_scale)
    return topk_order.top_keys(topk_order.order_keys(score, cols * dcp_size + dcp_rank, valid), topk)


def owned_slots(win: torch.Tensor, block_table: torch.Tensor, page_size: int, dcp_size: int, dcp_rank: int):
    """int32 [B, K]: physical slots of the winning keys (int64 [B, K], best first) this rank owns, in their order,
    then -1."""
    index = topk_order.key_index(win)
    mine = (win != topk_order.NONE) & (index % dcp_size == dcp_rank)
    pos = torch.where(mine, index // dcp_size, 0)  # local table position
    slot = layout.page_slots(block_table.long(), pos, page_size)
    out = torch.where(mine, slot, -1)
    order = torch.sort((~mine).to(torch.int8), dim=1, stable=True).indices  # owned first, best first
    return out.gather(1, order).to(torch.int32)


@torch.library.impl("dsa::dcp_indexer_topk", "CompositeImplicitAutograd")
def dcp_indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale, dcp_size, dcp_rank, group_name,
                     check_lens=True):
    """DSA indexer top-k over every rank's tokens, returned as THIS rank's slots.

    q [B, Hi, Di], weights float32 [B, Hi] (replicated: the same on every rank); k_cache [NP, PS, Di] and
    block_table int32 [B, MP]: this rank's shard of the indexer keys (token t on rank t % dcp_size at local
    position t // dcp_size); seq_lens int32 [B]: GLOBAL lengths. score(t) = sum_h weights[h] * relu(sm_scale *
    q[h] . k[t]) over t < seq_len, as `dsa::indexer_topk`.
    Returns int32 [B, topk]: the physical slots (of this shard) of the tokens this rank owns among the global
    top-min(topk, seq_len) tokens, best first, then -1. The ranks' lists together are exactly the set single-rank
    `dsa::indexer_topk` selects over the whole cache; ties on the k-th place go to the lower global token index on
    both. One all-gather of B * topk (score, token) pairs; the key cache never moves.
    check_lens=False: seq_lens may differ across ranks by design (callers handing per-rank token tables).
    """
    with agree.dcp_call(group_name, dcp_size, q, seq_lens) as call:
        check_dcp_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale, dcp_size, dcp_rank,
                               group_name, check_lens)
        if dcp_size == 1:
            return torch.ops.dsa.indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)
        B, Hi, Di = q.shape
        sig = agree.Signature(agree.OP_DSA, dcp_size, B, Hi, Di, topk, q.dtype, float(sm_scale), check_lens)
        if call is not None:
            call.agree(sig)
        local = layout.local_lens(seq_lens, dcp_size, dcp_rank)
        cand = torch.ops.dsa.dcp_local_candidates(q, weights, k_cache, block_table, local, topk, sm_scale, dcp_size,
                                                  dcp_rank)
    header = agree.data_header(sig, seq_lens)
    payloads, trails = agree.gather_with_trailer(cand.view(torch.int32), agree.trailer(seq_lens, header), dcp_size,
                                                 group_name)
    ok = agree.verdict(call, trails, header, sig)
    keys = payloads.contiguous().view(torch.int64)  # [n, B, topk]
    win = topk_order.top_keys(keys.permute(1, 0, 2).reshape(B, dcp_size * topk), topk)
    out = owned_slots(win, block_table, k_cache.shape[1], dcp_size, dcp_rank)
    if ok is not None:
        out = torch.where(ok[:, None], out, -1)
    return out
