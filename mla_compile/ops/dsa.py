"""DSA (DeepSeek Sparse Attention) indexer ops: `dsa::indexer_topk` and its k-only shortcut `dsa::k_only_indices`.

Both return PHYSICAL slots (block_table[b, t // PS] * PS + t % PS), the form `mla::sparse_decode` reads.
"""

from __future__ import annotations

import torch

from . import _checks as C
from .attention import token_slots


def _check_topk(topk):
    C.check(isinstance(topk, int) and topk > 0, "topk", f"must be a positive int, got {topk!r}")


def check_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    C.check_tensor(q, "q", 3, C.FLOAT_DTYPES)
    B, Hi, Di = q.shape
    C.check_tensor(weights, "weights", 2, torch.float32)
    C.check(tuple(weights.shape) == (B, Hi), "weights", f"shape {tuple(weights.shape)} must be [B, Hi] = {(B, Hi)}")
    C.check_tensor(k_cache, "k_cache", 3, C.FLOAT_DTYPES)
    C.check_dim(k_cache, "k_cache", 2, Di, "q.shape[-1] (index head dim Di)")
    C.check(k_cache.dtype == q.dtype, "k_cache", f"dtype {k_cache.dtype} differs from q's {q.dtype}")
    C.check(k_cache.shape[1] > 0, "k_cache", "page size must be positive")
    C.check_block_table(block_table, seq_lens, B)
    _check_topk(topk)
    C.check_scale(sm_scale)
    C.check_same_device(dict(q=q, weights=weights, k_cache=k_cache, block_table=block_table, seq_lens=seq_lens))
    C.check_block_table_data(block_table, seq_lens, k_cache.shape[0], k_cache.shape[1], int32_slots=True)


def check_k_only_args(block_table, seq_lens, page_size, topk):
    C.check_tensor(block_table, "block_table", 2, torch.int32)
    C.check_block_table(block_table, seq_lens, block_table.shape[0])
    C.check(isinstance(page_size, int) and page_size > 0, "page_size", f"must be a positive int, got {page_size!r}")
    _check_topk(topk)
    C.check_same_device(dict(block_table=block_table, seq_lens=seq_lens))
    if not C.is_fake(seq_lens) and C.data_checks_enabled(seq_lens.device) and seq_lens.numel():
        hi = int(seq_lens.max())
        C.check(hi <= topk, "seq_lens", f"k-only indexing needs every length <= topk ({topk}), saw {hi}")
    C.check_block_table_data(block_table, seq_lens, None, page_size, int32_slots=True)


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
    k = torch.where(valid[..., None], k_cache.reshape(-1, k_cache.shape[-1])[torch.where(valid, slots, 0)].float(),
                    0.0)  # [B, T, Di]; masked tokens zeroed (unused slots may hold NaN)
    logits = torch.relu(sm_scale * torch.einsum("bhd,btd->bht", q.float(), k))
    score = torch.einsum("bh,bht->bt", weights, logits)
    return score.masked_fill(~valid, float("-inf")), slots


@torch.library.custom_op(
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
    Rows with seq_len > topk list them by descending score. Rows with seq_len <= topk select every token,
    so they skip the logits and list their slots in token order (the k-only identity): one long request in
    a batch does not make the short ones pay for the indexer.
    """
    check_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)
    page_size = k_cache.shape[1]
    out = k_only_slots(block_table, seq_lens, page_size, topk)
    rows = (seq_lens > topk).nonzero().squeeze(1)  # CPU: data-dependent selection is free here
    if rows.numel():
        out[rows] = _topk_by_score(q[rows], weights[rows], k_cache, block_table[rows], seq_lens[rows], topk, sm_scale)
    return out


def _topk_by_score(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    score, slots = indexer_scores(q, weights, k_cache, block_table, seq_lens, sm_scale)
    valid = torch.arange(score.shape[1], device=score.device)[None, :] < seq_lens.long()[:, None]
    # Rank by a key where every valid token outranks every invalid one, even if its score overflowed to
    # +-inf or is NaN (else such a token would tie with the padding and come back as -1).
    big = torch.finfo(score.dtype).max
    key = torch.where(valid, torch.nan_to_num(score, nan=-big, posinf=big, neginf=-big), float("-inf"))
    k = min(topk, score.shape[1])
    _, pos = torch.topk(key, k, dim=1)
    picked = torch.where(valid.gather(1, pos), slots.gather(1, pos), -1)
    return _pad_cols(picked, topk).to(torch.int32)


@indexer_topk.register_fake
def _(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    check_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)
    return q.new_empty((q.shape[0], topk), dtype=torch.int32)


@indexer_topk.register_kernel("cuda")
def _(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    check_indexer_args(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)
    from ..kernels import dispatch

    return dispatch.indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)


@torch.library.custom_op(
    "dsa::k_only_indices",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor block_table, Tensor seq_lens, int page_size, int topk) -> Tensor",
)
def k_only_indices(block_table, seq_lens, page_size, topk):
    """Identity top-k for requests that fit entirely in the top-k budget (the indexer's logits are skipped).

    Shapes: block_table int32 [B, MP], seq_lens int32 [B]; every seq_len <= topk.
    Returns int32 [B, topk]: physical slots of tokens 0..seq_len-1 in order, then -1 — the same set
    `dsa::indexer_topk` selects when seq_len <= topk.
    """
    check_k_only_args(block_table, seq_lens, page_size, topk)
    return k_only_slots(block_table, seq_lens, page_size, topk)


def k_only_slots(block_table, seq_lens, page_size, topk):
    """Slots of tokens 0..min(seq_len, topk)-1 in order, then -1: int32 [B, topk]."""
    width = min(topk, block_table.shape[1] * page_size)
    slots = token_slots(block_table, page_size, width)
    valid = torch.arange(width, device=seq_lens.device)[None, :] < seq_lens.long()[:, None]
    return _pad_cols(torch.where(valid, slots, -1), topk).to(torch.int32)


@k_only_indices.register_fake
def _(block_table, seq_lens, page_size, topk):
    check_k_only_args(block_table, seq_lens, page_size, topk)
    return block_table.new_empty((block_table.shape[0], topk), dtype=torch.int32)


@k_only_indices.register_kernel("cuda")
def _(block_table, seq_lens, page_size, topk):
    check_k_only_args(block_table, seq_lens, page_size, topk)
    from ..kernels import dispatch

    return dispatch.k_only_indices(block_table, seq_lens, page_size, topk)
