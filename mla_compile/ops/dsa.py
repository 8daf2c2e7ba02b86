"""DSA (DeepSeek Sparse Attention) indexer ops: `dsa::indexer_topk` and its k-only shortcut `dsa::k_only_indices`.

Both return PHYSICAL slots (block_table[b, t // PS] * PS + t % PS), the form `mla::sparse_decode` reads.
"""

from __future__ import annotations

import torch

from .. import topk_order
from . import _checks as C
from ._plans import Plans, dispatch_module, dispatch_plan
from .attention import check_query_lens, merges_as_view, query_limits, token_slots
from ._registry import define


def _check_topk(topk):
    C.check(C.is_int(topk) and topk > 0, "topk", f"must be a positive int, got {topk!r}")


@C.once_per_signature
def check_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale, lens="seq_lens"):
    """`lens`: the lengths argument's name in the errors (a DCP rank's candidates take local_lens)."""
    C.check(isinstance(q, torch.Tensor), "q", f"expected a Tensor, got {type(q).__name__}")
    tokens = q.dim() == 4  # S query tokens per request: q [B, S, Hi, Di]
    C.check_tensor(q, "q", 4 if tokens else 3, C.FLOAT_DTYPES)
    B, Di = q.shape[0], q.shape[-1]
    lead = tuple(q.shape[:-1])  # (B, Hi) or (B, S, Hi)
    C.check_tensor(weights, "weights", len(lead), torch.float32)
    C.check(tuple(weights.shape) == lead, "weights", f"shape {tuple(weights.shape)} must be "
            f"{'[B, S, Hi]' if tokens else '[B, Hi]'} = {lead}")
    C.check_tensor(k_cache, "k_cache", 3, C.FLOAT_DTYPES)
    C.check_dim(k_cache, "k_cache", 2, Di, "q.shape[-1] (index head dim Di)")
    C.check(k_cache.dtype == q.dtype, "k_cache", f"dtype {k_cache.dtype} differs from q's {q.dtype}")
    C.check(k_cache.shape[1] > 0, "k_cache", "page size must be positive")
    C.check_block_table(block_table, seq_lens, B, lens)
    _check_topk(topk)
    C.check_scale(sm_scale)
    C.check_same_device({"q": q, "weights": weights, "k_cache": k_cache, "block_table": block_table, lens: seq_lens})
    C.check_block_table_data(block_table, seq_lens, k_cache.shape[0], k_cache.shape[1], int32_slots=True, lens=lens)
    check_query_lens(seq_lens, q.shape[1] if tokens else 1)


@C.once_per_signature
def check_k_only_args(block_table, seq_lens, page_size, topk, n_query=1):
    C.check_tensor(block_table, "block_table", 2, torch.int32)
    C.check_block_table(block_table, seq_lens, block_table.shape[0])
    C.check(C.is_int(page_size) and page_size > 0, "page_size", f"must be a positive int, got {page_size!r}")
    _check_topk(topk)
    C.check(C.is_int(n_query) and n_query >= 1, "n_query",
            f"must be an int >= 1, got {n_query!r}")
    check_query_lens(seq_lens, n_query)
    C.check_same_device(dict(block_table=block_table, seq_lens=seq_lens))
    if not C.is_fake(seq_lens) and C.data_checks_enabled(seq_lens.device) and seq_lens.numel():
        hi = int(seq_lens.max())
        C.check(hi <= topk, "seq_lens", f"k-only indexing needs every length <= topk ({topk}), saw {hi}")
    C.check_block_table_data(block_table, seq_lens, None, page_size, int32_slots=True)


def per_query_token(block_table: torch.Tensor, seq_lens: torch.Tensor, S: int):
    """S query tokens per request as B*S requests of their own: (block_table [B*S, MP], lengths int32 [B*S]),
    row b*S + j being query token j of request b with the tokens it may see (`query_limits`, >= 0). Each query
    token takes its own top-k, so the rows share nothing else. Device ops only, no host sync."""
    limits = query_limits(seq_lens, S).clamp_min(0)
    return block_table.repeat_interleave(S, dim=0), limits.reshape(-1)


def _pad_cols(x: torch.Tensor, width: int) -> torch.Tensor:
    if x.shape[1] >= width:
        return x[:, :width]
    return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=-1)


def indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale):
    """score[b, t] = sum_h weights[b, h] * relu(sm_scale * q[b, h] . k[t]) over t < seq_len (else -inf)."""
    page_size = k_cache.shape[1]
    T = int(seq_lens.max()) if seq_lens.numel() else 0
    slots = token_slots(block_table, page_size, T)
    valid = torch.arange(T, device=seq_lens.device)[None, :] < seq_lens.long()[:, None]
    return slot_scores(q, weights, k_cache, slots, valid, sm_scale), slots


def slot_scores(q, weights, k_cache, slots, valid, sm_scale):
    """float32 [B, T]: the indexer score of the token at slots[b, t] of k_cache [NP, PS, Di] where valid (else -inf).
    The one scoring formula of the CPU paths (single rank and each DCP rank score a token the same way)."""
    k = k_cache.reshape(-1, k_cache.shape[-1])[torch.where(valid, slots, 0)].float()
    k = torch.where(valid[..., None], k, 0.0)  # [B, T, Di]; masked tokens zeroed (unused slots may hold NaN)
    logits = torch.relu(sm_scale * torch.einsum("bhd,btd->bht", q.float(), k))
    score = torch.einsum("bh,bht->bt", weights, logits)
    return score.masked_fill(~valid, float("-inf"))


@define(
    "dsa::indexer_topk",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor q, Tensor weights, Tensor k_cache, Tensor block_table, Tensor seq_lens, int topk, "
           "float sm_scale) -> Tensor",
)
def indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    """DSA lightning indexer: top-k tokens of each request by indexer score, as physical slots.

    Shapes: q [B, Hi, Di], weights float32 [B, Hi], k_cache [NP, PS, Di] (one shared key head),
    block_table int32 [B, MP], seq_lens int32 [B]; topk > 0.
    score(t) = sum_h weights[h] * relu(sm_scale * q[h] . k[t]) for t < seq_len.
    Returns int32 [B, topk]: physical slots of the top min(topk, seq_len) tokens, then -1.
    Rows with seq_len > topk list them by descending score; equal scores go to the lower token index
    (`mla_compile.topk_order`: the one tie rule, shared with `dsa::dcp_indexer_topk`). Rows with seq_len <= topk
    select every token, so they skip the logits and list their slots in token order (the k-only identity): one long
    request in a batch does not make the short ones pay for the indexer.
    S query tokens per request: q [B, S, Hi, Di], weights float32 [B, S, Hi] -> int32 [B, S, topk], query token j
    ranking the tokens it may see, t < seq_lens[b] - S + 1 + j (seq_lens counts the S new tokens; 0 or >= S).
    """
    check_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)
    if q.dim() == 4:
        B, S = q.shape[:2]
        table, lens = per_query_token(block_table, seq_lens, S)
        out = _indexer_topk(q.reshape(B * S, *q.shape[2:]), weights.reshape(B * S, -1), k_cache, table, lens, topk,
                            sm_scale)
        return out.view(B, S, topk)
    return _indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)


def _indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    page_size = k_cache.shape[1]
    out = k_only_slots(block_table, seq_lens, page_size, topk)
    rows = (seq_lens > topk).nonzero().squeeze(1)  # CPU: data-dependent selection is free here
    if rows.numel():
        out[rows] = _topk_by_score(q[rows], weights[rows], k_cache, block_table[rows], seq_lens[rows], topk, sm_scale)
    return out


def _topk_by_score(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    score, slots = indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale)
    valid = torch.arange(score.shape[1], device=score.device)[None, :] < seq_lens.long()[:, None]
    # score descending, ties to the lower token index (`topk_order`); a valid token outranks padding even if its
    # score overflowed to +-inf or is NaN
    pos, picked = topk_order.top_positions(score, valid, topk)
    picked = torch.where(picked, slots.gather(1, pos.clamp(max=max(score.shape[1] - 1, 0))), -1)
    return _pad_cols(picked, topk).to(torch.int32)


@indexer_topk.register_fake
def _(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    check_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)
    return q.new_empty((*q.shape[:-2], topk), dtype=torch.int32)


@indexer_topk.register_kernel("cuda")
def _indexer_topk_cuda(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    return _PLANS.run((q, weights, k_cache, block_table, seq_lens), (topk, sm_scale), check_indexer_args,
                      _make_indexer_plan, (q, weights, k_cache, block_table, seq_lens, topk, sm_scale))


def _make_indexer_plan(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    """(plan, keep) for `Plans.run`: q [B, Hi, Di] -> kernels/dispatch.py's plan; q [B, S, Hi, Di] (S query tokens)
    -> the same over B*S rows of their own (`per_query_token`'s rows, each row's table and tokens found in the
    kernels), its result allocated as [B, S, topk]; q and weights taken as they are where folding their (B, S) is a
    view (their strides allow), else reshaped each call."""
    dispatch = dispatch_module()
    if q.dim() == 3:
        return dispatch.indexer_topk_plan(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)
    B, S = q.shape[:2]
    rows_q, rows_w = (B * S, *q.shape[2:]), (B * S, weights.shape[-1])
    inner, keep = dispatch.indexer_topk_plan(q.reshape(rows_q), weights.reshape(rows_w), k_cache, block_table,
                                             seq_lens, topk, sm_scale, n_query=S, out_shape=(B, S, topk))
    if merges_as_view(q, weights, dim=0):
        return inner, keep

    def plan(q, weights, k_cache, block_table, seq_lens):
        return inner(q.reshape(rows_q), weights.reshape(rows_w), k_cache, block_table, seq_lens)

    return plan, keep


_make_k_only_plan = dispatch_plan("k_only_indices_plan")


_PLANS = Plans()  # q [B, Hi, Di]: one plan per call signature (ops/_plans.py)
_K_ONLY_PLANS = Plans()  # dsa::k_only_indices with one query token


@define(
    "dsa::k_only_indices",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor block_table, Tensor seq_lens, int page_size, int topk, int n_query=1) -> Tensor",
)
def k_only_indices(block_table, seq_lens, page_size, topk, n_query=1):
    """Identity top-k for requests that fit entirely in the top-k budget (the indexer's logits are skipped).

    Shapes: block_table int32 [B, MP], seq_lens int32 [B]; every seq_len <= topk.
    Returns int32 [B, topk]: physical slots of tokens 0..seq_len-1 in order, then -1 — the same set
    `dsa::indexer_topk` selects when seq_len <= topk.
    n_query = S > 1 query tokens per request: int32 [B, S, topk], query token j listing the tokens it may see,
    0 .. seq_lens[b] - S + j (seq_lens counts the S new tokens; 0 or >= S) — what `dsa::indexer_topk` gives q
    [B, S, Hi, Di] there.
    """
    check_k_only_args(block_table, seq_lens, page_size, topk, n_query)
    if n_query > 1:
        table, lens = per_query_token(block_table, seq_lens, n_query)
        return k_only_slots(table, lens, page_size, topk).view(block_table.shape[0], n_query, topk)
    return k_only_slots(block_table, seq_lens, page_size, topk)


def k_only_slots(block_table, seq_lens, page_size, topk):
    """Slots of tokens 0..min(seq_len, topk)-1 in order, then -1: int32 [B, topk]."""
    width = min(topk, block_table.shape[1] * page_size)
    slots = token_slots(block_table, page_size, width)
    valid = torch.arange(width, device=seq_lens.device)[None, :] < seq_lens.long()[:, None]
    return _pad_cols(torch.where(valid, slots, -1), topk).to(torch.int32)


@k_only_indices.register_fake
def _(block_table, seq_lens, page_size, topk, n_query=1):
    check_k_only_args(block_table, seq_lens, page_size, topk, n_query)
    lead = (block_table.shape[0], n_query) if n_query > 1 else (block_table.shape[0],)
    return block_table.new_empty((*lead, topk), dtype=torch.int32)


@k_only_indices.register_kernel("cuda")
def _(block_table, seq_lens, page_size, topk, n_query=1):
    if n_query == 1:  # a plan per signature (ops/_plans.py)
        return _K_ONLY_PLANS.run((block_table, seq_lens), (page_size, topk), check_k_only_args, _make_k_only_plan,
                                 (block_table, seq_lens, page_size, topk))
    # S query tokens: B*S rows of their own (`per_query_token`), a plan per signature too
    return _K_ONLY_PLANS.run((block_table, seq_lens), (page_size, topk, n_query), check_k_only_args,
                             _make_k_only_tokens_plan, (block_table, seq_lens, page_size, topk, n_query))


def _make_k_only_tokens_plan(block_table, seq_lens, page_size, topk, n_query):
    """(plan, keep): `dsa::k_only_indices` of n_query > 1 query tokens per request: [B, S, topk] from one launch over
    the B*S query rows (each row's table and tokens found in the kernel, kernels/dsa.py `_row_tokens`)."""
    return dispatch_module().k_only_indices_plan(block_table, seq_lens, page_size, topk, n_query)
