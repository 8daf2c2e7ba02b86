"""Token layout math — the ONE place it lives: DCP ownership and the slot of a token in a paged cache.

Token t of a request is owned by rank ``t % n`` at local position ``t // n`` (token-cyclic sharding).
Rank r therefore holds ``L // n + (r < L % n)`` of a request's L tokens; the ranks' counts sum to L, and a
decode step's new token (position L-1) grows exactly rank ``(L-1) % n``. A rank may own nothing (n > L).
A token at (local) position t of request b sits at slot ``block_table[b, t // PS] * PS + t % PS`` of its rank's
pages (`page_slots`). Every path (ops, caches, passes, tests) derives local lengths, shards and slots from these
functions. This module imports nothing of ours: ops, caches and passes all build on it.

Functions taking `aten=` are written in ATen ops: called on tensors they run eagerly; the attention pass calls
them with `aten=` a graph builder's namespace (`passes._fx.Builder.aten`) and so emits the same code into the graph.
"""

from __future__ import annotations

import torch


def check_group(dcp_size, dcp_rank) -> None:
    """dcp_size an int >= 1 and dcp_rank an int in [0, dcp_size) (a bool is neither); else a ValueError naming it."""
    if not (isinstance(dcp_size, int) and not isinstance(dcp_size, bool) and dcp_size >= 1):
        raise ValueError(f"dcp_size: must be an int >= 1, got {dcp_size!r}")
    if not (isinstance(dcp_rank, int) and not isinstance(dcp_rank, bool) and 0 <= dcp_rank < dcp_size):
        raise ValueError(f"dcp_rank: must be an int in [0, dcp_size={dcp_size}), got {dcp_rank!r}")


def owner_rank(position, dcp_size: int):
    """Rank owning global token `position` (int or tensor)."""
    return position % dcp_size


def local_position(position, dcp_size: int):
    """Position of global token `position` inside its owner's shard."""
    return position // dcp_size


def local_lens(seq_lens, dcp_size: int, dcp_rank: int):
    """Tokens of each request held by `dcp_rank`: L // n + (rank < L % n). Works on ints and tensors
    (keeps the tensor's dtype and device; no host sync)."""
    check_group(dcp_size, dcp_rank)
    if isinstance(seq_lens, torch.Tensor):
        # the same count as one expression, (L + n-1-r) // n: 2 kernels instead of 5 inside a CUDA graph
        return (seq_lens + (dcp_size - 1 - dcp_rank)) // dcp_size
    return seq_lens // dcp_size + int(dcp_rank < seq_lens % dcp_size)


def local_capacity(max_len: int, dcp_size: int) -> int:
    """Tokens of one request a rank must be able to hold: ceil(max_len / n)."""
    check_group(dcp_size, 0)
    return -(-max_len // dcp_size)


def local_token_positions(seq_len: int, dcp_size: int, dcp_rank: int) -> torch.Tensor:
    """Global positions, in local order, of the tokens `dcp_rank` owns of a request of length seq_len."""
    check_group(dcp_size, dcp_rank)
    return torch.arange(dcp_rank, max(seq_len, dcp_rank), dcp_size)  # empty when the rank owns nothing


def lens_holding(local_counts, dcp_size: int, aten=torch.ops.aten):
    """GLOBAL lengths whose share on this rank (`local_lens`) is `local_counts` (int tensor [B]): count * n, since
    (c * n + n-1-r) // n = c on every rank r. For handing an op that takes global lengths (`mla::dcp_decode`) a
    rank's own token count; lengths made so differ between ranks, so that op must not compare them across ranks
    (its check_lens=False)."""
    return aten.mul.Tensor(local_counts, dcp_size)


def local_mask(valid, length: int, dcp_size: int, dcp_rank: int, capacity: int, aten=torch.ops.aten):
    """The tokens rank `dcp_rank` holds of a per-token mask over GLOBAL positions: valid bool [B, length] ->
    [B, capacity], local position j <- global token j * n + r (False where that token is past `length`)."""
    check_group(dcp_size, dcp_rank)
    need = capacity * dcp_size
    if need > length:  # positions >= length hold no token
        valid = aten.constant_pad_nd.default(valid, [0, need - length], False)
    else:
        valid = aten.slice.Tensor(valid, 1, 0, need)
    return aten.select.int(aten.reshape.default(valid, [-1, capacity, dcp_size]), 2, dcp_rank)


def interleave_shards(shards: torch.Tensor) -> torch.Tensor:
    """Every rank's tokens back in global order: shards [n, B, capacity, ...] (rank r's local position j at
    [r, b, j]) -> [B, n * capacity, ...] with global token t = j * n + r at [b, t]."""
    n, B, cap = shards.shape[:3]
    return shards.movedim(0, 2).reshape(B, cap * n, *shards.shape[3:])


def page_slots(block_table, t, page_size: int, rows=None, aten=torch.ops.aten):
    """Slots of (local) token positions t in a paged cache: block_table[row, t // PS] * PS + t % PS (the dtype
    of the table and t promoted). rows None: t [B, T] holds row b's positions in row b; else rows [T] and t [T] (token i of
    request rows[i]). Every t must lie inside its row's table (callers clamp or mask the rest)."""
    page = aten.div.Tensor_mode(t, page_size, rounding_mode="floor")
    if rows is None:
        page = aten.gather.default(block_table, 1, aten._to_copy.default(page, dtype=torch.int64))
    else:
        page = aten.index.Tensor(block_table, [rows, page])
    return aten.add.Tensor(aten.mul.Tensor(page, page_size), aten.remainder.Scalar(t, page_size))


def owner_slots(block_table: torch.Tensor, req_indices: torch.Tensor, positions: torch.Tensor, page_size: int,
                dcp_size: int = 1, dcp_rank: int = 0, check: bool | None = None) -> torch.Tensor:
    """Write slots for new tokens: the physical slot in this rank's shard, or -1 if another rank owns it.

    block_table int32 [B, MP] holds THIS rank's pages; req_indices [T] says which request each token
    belongs to; positions [T] are GLOBAL token positions. Returns int64 [T] for `mla::cache_write`.

    A token with no slot (negative position, request index outside [0, B), or owned here but past the
    block table's capacity) is an error when `check` is on, else it gets -1 (skipped) rather than some
    other token's slot. `check=None` checks where reading the values costs no device sync (eager CPU
    tensors); callers that accept a sync elsewhere (e.g. CUDA debugging) pass True, under torch.compile
    it is always off.
    """
    check_group(dcp_size, dcp_rank)
    if page_size <= 0:
        raise ValueError(f"page_size: must be positive, got {page_size}")
    positions, req_indices = positions.long(), req_indices.long()
    B, MP = block_table.shape
    local = local_position(positions, dcp_size)
    has_token = (positions >= 0) & (req_indices >= 0) & (req_indices < B)
    mine = owner_rank(positions, dcp_size) == dcp_rank
    fits = local < MP * page_size
    if check is None:
        check = positions.device.type == "cpu"
    if check and not torch.compiler.is_compiling() and not _is_fake(positions) and positions.numel():
        _raise_unslotted(block_table, req_indices, positions, page_size, dcp_size, dcp_rank, has_token, mine, fits)
    if B and MP:  # tokens without a slot read some in-table entry and are masked below
        row = req_indices.clamp(min=0, max=B - 1)
        slots = page_slots(block_table.long(), local.clamp(min=0, max=MP * page_size - 1), page_size, rows=row)
    else:
        slots = torch.zeros_like(local)
    return torch.where(has_token & mine & fits, slots, torch.full_like(slots, -1))


def _raise_unslotted(block_table, req_indices, positions, page_size, dcp_size, dcp_rank, has_token, mine, fits):
    if bool((positions < 0).any()):
        raise ValueError(f"positions: must be >= 0, saw {int(positions.min())}")
    if not bool(has_token.all()):
        bad = int(req_indices[~has_token][0])
        raise ValueError(f"req_indices: must be in [0, {block_table.shape[0]}) (rows of block_table), saw {bad}")
    if bool((mine & ~fits).any()):
        bad = int(positions[mine & ~fits][0])
        raise ValueError(f"positions: token {bad} (local position {bad // dcp_size} on rank {dcp_rank}) is past the "
                         f"block table's capacity of {block_table.shape[1]} pages x {page_size}")


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or t.device.type == "meta"
