"""The DSA indexer's top-k order, one definition for every path: score descending, ties to the lower token index.

`torch.topk` defines no order among equal scores, so two top-k implementations (or one rank against a group of
ranks) may pick different tokens at a tie on the k-th place. Here every (score, token index) pair becomes ONE
int64 key whose integer order is that total order:

    key = ord(score) * 2^32 + (2^32 - 1 - index)

`ord` maps float32 bits to int32 monotonically (non-negative floats keep their bits, negative ones flip their
magnitude bits), after -0.0 -> +0.0 and non-finite scores clamped (NaN and -inf to -max, +inf to +max: a valid
token always outranks padding). A top-k over distinct keys is unique, so single-rank `dsa::indexer_topk` and
`dsa::dcp_indexer_topk` select the same set. The key also carries the index, so a DCP rank sends its
candidates' (score, token) pairs as one int64 each. `NONE` (int64 min) is below every real key: padding.

This module imports nothing of ours (kernels and ops both use it). The CUDA indexer computes these keys inside its
logits kernel (kernels/dsa.py `_order_key`, a second implementation of this definition): a change here must change
it too; tests/kernels/test_indexer_kernels.py asserts the two agree bit for bit.
"""

from __future__ import annotations

import torch

NONE = -(2**63)  # no candidate: below every key of a real token
_LOW = 2**32 - 1
_FLIP = 0x7FFFFFFF


def order_keys(score: torch.Tensor, index: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """int64 keys (same shape as score) ordering tokens by score descending, then lower `index` first; NONE where
    not valid. score: float (computed in float32), index: integer in [0, 2^32), valid: bool; all broadcastable."""
    s = score.float()
    big = torch.finfo(torch.float32).max
    bits = torch.nan_to_num(s, nan=-big, posinf=big, neginf=-big).view(torch.int32)
    # -0.0 -> +0.0 (one tie class) on the bits, as the kernels do: a compiler may fold `x + 0.0` away
    bits = torch.where(bits == -(2**31), 0, bits)
    ordered = torch.where(bits >= 0, bits, bits ^ _FLIP).to(torch.int64)
    # index ^ _LOW is _LOW - index for index in [0, 2^32): written as a xor, Inductor keeps it an int64 op, while the
    # subtraction of an arange-derived index folds into an int32 index expression whose 2^32 - 1 literal does not
    # compile for CUDA ("Scalar 4294967295 is out of range for type int32", torch 2.11: dcp_indexer_topk compiled)
    key = ordered * (2**32) + (index.to(torch.int64) ^ _LOW)
    return torch.where(valid, key, torch.full_like(key, NONE))


def key_index(key: torch.Tensor) -> torch.Tensor:
    """The token index a key carries (int64; meaningless for NONE)."""
    return _LOW - (key & _LOW)


def top_keys(key: torch.Tensor, k: int) -> torch.Tensor:
    """The k largest keys of each row (last dim), largest first; rows narrower than k are padded with NONE."""
    width = key.shape[-1]
    top = torch.topk(key, min(k, width), dim=-1).values
    if width >= k:
        return top
    pad = torch.full((*key.shape[:-1], k - width), NONE, dtype=torch.int64, device=key.device)
    return torch.cat([top, pad], dim=-1)


def top_positions(score: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions int64 [B, min(k, T)], picked bool) of the top-k columns of score [B, T] in the order above (index =
    column); picked False where fewer than k columns are valid."""
    cols = torch.arange(score.shape[-1], device=score.device)
    key = top_keys(order_keys(score, cols, valid), min(k, score.shape[-1]))
    return key_index(key), key != NONE
