"""`mla::decode` and `mla::sparse_decode`: absorbed-MLA decode attention over the paged latent cache.

Registration choice: `torch.library.custom_op` + `register_kernel("cpu"/"cuda")`. Each op is one opaque
node to Inductor (an extern call), which is what we want for a hand-tuned attention kernel: Inductor has
nothing to fuse across it, and the CUDA impl launches Triton kernels with no host sync, so CUDA graphs
capture it as-is. The CPU impl is plain vectorized torch and is the reference the kernels are tested against.
"""

from __future__ import annotations

import torch

from . import _checks as C

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------- validation
def _check_q(q_nope, q_pe):
    C.check_tensor(q_nope, "q_nope", 3, C.FLOAT_DTYPES)
    C.check_tensor(q_pe, "q_pe", 3, C.FLOAT_DTYPES)
    C.check(q_pe.dtype == q_nope.dtype, "q_pe", f"dtype {q_pe.dtype} differs from q_nope's {q_nope.dtype}")
    C.check(q_pe.shape[:2] == q_nope.shape[:2], "q_pe",
            f"batch/heads {tuple(q_pe.shape[:2])} differ from q_nope's {tuple(q_nope.shape[:2])}")


def _check_cache_dtype(q_nope, ckv_cache, kpe_cache):
    C.check(ckv_cache.dtype == q_nope.dtype, "ckv_cache", f"dtype {ckv_cache.dtype} differs from q_nope's {q_nope.dtype}")
    C.check(kpe_cache.dtype == q_nope.dtype, "kpe_cache", f"dtype {kpe_cache.dtype} differs from q_nope's {q_nope.dtype}")


def check_decode_metadata(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale) -> tuple[int, int]:
    """Shapes, dtypes, devices of a decode call (no data read); returns (num_pages, page_size)."""
    _check_q(q_nope, q_pe)
    B, _, R = q_nope.shape
    num_pages, page_size = C.check_paged_cache(ckv_cache, kpe_cache, R, q_pe.shape[2])
    _check_cache_dtype(q_nope, ckv_cache, kpe_cache)
    C.check_block_table(block_table, seq_lens, B)
    C.check_scale(sm_scale)
    C.check_same_device(dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache,
                             block_table=block_table, seq_lens=seq_lens))
    return num_pages, page_size


def check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    num_pages, page_size = check_decode_metadata(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)
    C.check_block_table_data(block_table, seq_lens, num_pages, page_size)


def check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    _check_q(q_nope, q_pe)
    num_pages, page_size = C.check_paged_cache(ckv_cache, kpe_cache, q_nope.shape[2], q_pe.shape[2])
    _check_cache_dtype(q_nope, ckv_cache, kpe_cache)
    C.check_tensor(indices, "indices", 2, torch.int32)
    C.check_dim(indices, "indices", 0, q_nope.shape[0], "the batch size")
    C.check_scale(sm_scale)
    C.check_same_device(dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache, indices=indices))
    if not C.is_fake(indices) and C.data_checks_enabled(indices.device) and indices.numel():
        lo, hi = int(indices.min()), int(indices.max())
        C.check(lo >= -1 and hi < num_pages * page_size, "indices",
                f"slots must be -1 or in [0, {num_pages * page_size}), saw {lo if lo < -1 else hi}")


# ------------------------------------------------------------------------------------------- CPU reference
def token_slots(block_table: torch.Tensor, page_size: int, num_tokens: int) -> torch.Tensor:
    """Physical slot of logical token t for every row: block_table[b, t // PS] * PS + t % PS -> int64[B, T]."""
    t = torch.arange(num_tokens, device=block_table.device)
    return block_table.long()[:, t // page_size] * page_size + t % page_size


def attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale):
    """Attention of every head over the listed slots; `valid` masks slots out. fp32 math, (out, lse)."""
    R, P = ckv_cache.shape[-1], kpe_cache.shape[-1]
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    keep = valid[..., None]
    # zero masked tokens: unused slots may hold anything (NaN), and 0-probability * NaN is still NaN
    ckv = torch.where(keep, ckv_cache.reshape(-1, R)[safe].float(), 0.0)  # [B, T, R]
    kpe = torch.where(keep, kpe_cache.reshape(-1, P)[safe].float(), 0.0)  # [B, T, P]
    scores = sm_scale * (torch.einsum("bhr,btr->bht", q_nope.float(), ckv)
                         + torch.einsum("bhp,btp->bht", q_pe.float(), kpe))
    scores = scores.masked_fill(~valid[:, None, :], _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with no valid slot
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    out = torch.einsum("bht,btr->bhr", probs, ckv)
    return out.to(q_nope.dtype).contiguous(), lse.contiguous()


# --------------------------------------------------------------------------------------------- mla::decode
@torch.library.custom_op(
    "mla::decode",
    mutates_args=(),
    device_types="cpu",
    tags=(torch.Tag.flexible_layout,),  # q may come in any batch/head strides (a permuted bmm output)
    schema="(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor block_table, "
           "Tensor seq_lens, float sm_scale) -> (Tensor, Tensor)",
)
def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    """Absorbed-MLA decode attention over a paged latent cache (one query token per request).

    Shapes: q_nope [B, H, R], q_pe [B, H, P] (R = kv_lora_rank, P = rope dim); ckv_cache [NP, PS, R],
    kpe_cache [NP, PS, P] (NP pages of PS tokens); block_table int32 [B, MP]; seq_lens int32 [B].
    Token t < seq_lens[b] of request b sits at slot block_table[b, t // PS] * PS + t % PS.
    scores = sm_scale * (q_nope . ckv + q_pe . kpe); returns out [B, H, R] (q's dtype) = softmax(scores) . ckv
    and lse float32 [B, H] = logsumexp(scores) (natural log). A row with seq_lens 0 gives (0, -inf).
    """
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)
    page_size = ckv_cache.shape[1]
    T = int(seq_lens.max()) if seq_lens.numel() else 0  # CPU: reading lengths is free; gather only what is used
    slots = token_slots(block_table, page_size, T)
    valid = torch.arange(T, device=seq_lens.device)[None, :] < seq_lens.long()[:, None]
    return attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale)


@decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)
    B, H, _ = q_nope.shape
    # contiguous, like the real impls (not empty_like: q_nope is often a transposed view after absorption)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty((B, H), dtype=torch.float32)


@decode.register_kernel("cuda")
def _(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)
    from ..kernels import dispatch

    return dispatch.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)


# -------------------------------------------------------------------------------------- mla::sparse_decode
@torch.library.custom_op(
    "mla::sparse_decode",
    mutates_args=(),
    device_types="cpu",
    tags=(torch.Tag.flexible_layout,),  # q may come in any batch/head strides (a permuted bmm output)
    schema="(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor indices, float sm_scale)"
           " -> (Tensor, Tensor)",
)
def sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    """Absorbed-MLA decode attention over the listed PHYSICAL slots only (DSA top-k attention).

    Shapes: q_nope [B, H, R], q_pe [B, H, P], ckv_cache [NP, PS, R], kpe_cache [NP, PS, P],
    indices int32 [B, K] (flat slots page * PS + offset; -1 = ignored). Same math as `mla::decode` over the
    selected tokens; a row with no valid slot gives (0, -inf). Returns out [B, H, R], lse float32 [B, H].
    """
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)
    slots = indices.long()
    return attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, slots >= 0, sm_scale)


@sparse_decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)
    B, H, _ = q_nope.shape
    # contiguous, like the real impls (not empty_like: q_nope is often a transposed view after absorption)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty((B, H), dtype=torch.float32)


@sparse_decode.register_kernel("cuda")
def _(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)
    from ..kernels import dispatch

    return dispatch.sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)
