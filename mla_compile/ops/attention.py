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
def _check_q(q_nope, q_pe, dtypes):
    C.check_tensor(q_nope, "q_nope", 3, dtypes)
    C.check_tensor(q_pe, "q_pe", 3, dtypes)
    C.check(q_pe.dtype == q_nope.dtype, "q_pe", f"dtype {q_pe.dtype} differs from q_nope's {q_nope.dtype}")
    C.check(q_pe.shape[:2] == q_nope.shape[:2], "q_pe",
            f"batch/heads {tuple(q_pe.shape[:2])} differ from q_nope's {tuple(q_nope.shape[:2])}")


def _check_cache_dtype(q_nope, ckv_cache, kpe_cache):
    C.check(ckv_cache.dtype == q_nope.dtype, "ckv_cache", f"dtype {ckv_cache.dtype} differs from q_nope's {q_nope.dtype}")
    C.check(kpe_cache.dtype == q_nope.dtype, "kpe_cache", f"dtype {kpe_cache.dtype} differs from q_nope's {q_nope.dtype}")


def check_decode_metadata(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                          dtypes=C.FLOAT_DTYPES) -> tuple[int, int]:
    """Shapes, dtypes, devices of a decode call (no data read); returns (num_pages, page_size).
    `dtypes`: the q / cache dtypes the caller takes (mla::decode adds float64; DCP's lse packing does not)."""
    _check_q(q_nope, q_pe, dtypes)
    B, _, R = q_nope.shape
    num_pages, page_size = C.check_paged_cache(ckv_cache, kpe_cache, R, q_pe.shape[2], dtypes)
    _check_cache_dtype(q_nope, ckv_cache, kpe_cache)
    C.check_block_table(block_table, seq_lens, B)
    C.check_scale(sm_scale)
    C.check_same_device(dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache,
                             block_table=block_table, seq_lens=seq_lens))
    return num_pages, page_size


def check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    num_pages, page_size = check_decode_metadata(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                                 C.REFERENCE_DTYPES)
    C.check_block_table_data(block_table, seq_lens, num_pages, page_size)


def check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    _check_q(q_nope, q_pe, C.REFERENCE_DTYPES)
    num_pages, page_size = C.check_paged_cache(ckv_cache, kpe_cache, q_nope.shape[2], q_pe.shape[2],
                                               C.REFERENCE_DTYPES)
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


def decode_slots(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_tokens: int):
    """(slots int64 [B, T], valid bool [B, T]) of the first num_tokens logical tokens of every request."""
    valid = torch.arange(num_tokens, device=seq_lens.device)[None, :] < seq_lens.long()[:, None]
    return token_slots(block_table, page_size, num_tokens), valid


def _slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """[NP, PS, D] -> [NP * PS, D] by explicit sizes: reshape(-1, D) is ambiguous for a rope-less D = 0."""
    return cache.reshape(cache.shape[0] * cache.shape[1], cache.shape[2])


def _gather_slots(ckv_cache, kpe_cache, slots, valid, dtype):
    """(safe slots, ckv [B, T, R], kpe [B, T, P]) in `dtype`; masked tokens read slot 0 and are zeroed.
    P = 0 (rope-less MLA) gives kpe [B, T, 0], whose products below are exactly 0."""
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    keep = valid[..., None]
    # zero masked tokens: unused slots may hold anything (NaN), and 0-probability * NaN is still NaN
    ckv = torch.where(keep, _slot_rows(ckv_cache)[safe].to(dtype), 0.0)
    kpe = torch.where(keep, _slot_rows(kpe_cache)[safe].to(dtype), 0.0)
    return safe, ckv, kpe


def _softmax_over_slots(q_nope, q_pe, ckv, kpe, valid, sm_scale):
    """(probs [B, H, T], lse [B, H]) of scores = sm_scale * (q_nope . ckv + q_pe . kpe); a row with no valid
    slot gives probs 0 and lse -inf."""
    scores = sm_scale * (torch.einsum("bhr,btr->bht", q_nope, ckv) + torch.einsum("bhp,btp->bht", q_pe, kpe))
    scores = scores.masked_fill(~valid[:, None, :], _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with no valid slot
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return probs, lse


def attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale):
    """Attention of every head over the listed slots; `valid` masks slots out. (out, lse); the math runs in
    C.lse_dtype (float32, float64 for float64 inputs)."""
    dt = C.lse_dtype(q_nope.dtype)
    _, ckv, kpe = _gather_slots(ckv_cache, kpe_cache, slots, valid, dt)
    probs, lse = _softmax_over_slots(q_nope.to(dt), q_pe.to(dt), ckv, kpe, valid, sm_scale)
    out = torch.einsum("bht,btr->bhr", probs, ckv)
    return out.to(q_nope.dtype).contiguous(), lse.contiguous()


def attend_slots_backward(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale, grad_out, grad_lse):
    """Gradients of `attend_slots` w.r.t. (q_nope, q_pe, ckv_cache, kpe_cache), the softmax recomputed.

    With p = softmax(s), out = p . v and lse = logsumexp(s): ds = p * (dout . v - dout . out + dlse);
    dq = sm_scale * ds . k; dk = sm_scale * ds^T . q; dv = p^T . dout. Token gradients are summed into their
    slots (a slot listed twice gets both); masked tokens, empty rows and unused slots get exactly 0.
    Plain torch with static shapes (no data-dependent size), so AOTAutograd traces it into the backward graph.
    """
    dt = C.lse_dtype(q_nope.dtype)
    qn, qp = q_nope.to(dt), q_pe.to(dt)
    safe, ckv, kpe = _gather_slots(ckv_cache, kpe_cache, slots, valid, dt)
    probs, _ = _softmax_over_slots(qn, qp, ckv, kpe, valid, sm_scale)
    out = torch.einsum("bht,btr->bhr", probs, ckv)
    g_out = torch.zeros_like(out) if grad_out is None else grad_out.to(dt)
    g_lse = torch.zeros_like(out[..., 0]) if grad_lse is None else grad_lse.to(dt)
    d_probs = torch.einsum("bhr,btr->bht", g_out, ckv)
    d_scores = probs * (d_probs - (g_out * out).sum(-1, keepdim=True) + g_lse[..., None])
    d_q_nope = sm_scale * torch.einsum("bht,btr->bhr", d_scores, ckv)
    d_q_pe = sm_scale * torch.einsum("bht,btp->bhp", d_scores, kpe)
    d_ckv = sm_scale * torch.einsum("bht,bhr->btr", d_scores, qn) + torch.einsum("bht,bhr->btr", probs, g_out)
    d_kpe = sm_scale * torch.einsum("bht,bhp->btp", d_scores, qp)

    def to_slots(d_tok, cache):  # [B, T, D] -> cache-shaped sums per slot
        # masked tokens point at slot 0: keep whatever they carry (0 * a non-finite upstream grad) out of it
        d_tok = torch.where(valid[..., None], d_tok, 0.0)
        flat = d_tok.new_zeros(cache.shape[0] * cache.shape[1], cache.shape[2])
        rows = d_tok.reshape(d_tok.shape[0] * d_tok.shape[1], cache.shape[2])  # explicit: D may be 0 (no rope)
        return flat.index_add(0, safe.reshape(-1), rows).view(cache.shape).to(cache.dtype)

    return (d_q_nope.to(q_nope.dtype), d_q_pe.to(q_pe.dtype), to_slots(d_ckv, ckv_cache), to_slots(d_kpe, kpe_cache))


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

    Shapes: q_nope [B, H, R], q_pe [B, H, P] (R = kv_lora_rank >= 1, P = rope dim >= 0); ckv_cache [NP, PS, R],
    kpe_cache [NP, PS, P] (NP pages of PS tokens); block_table int32 [B, MP]; seq_lens int32 [B].
    P = 0 is rope-less MLA (q_pe [B, H, 0], kpe_cache [NP, PS, 0]): scores = sm_scale * q_nope . ckv.
    Token t < seq_lens[b] of request b sits at slot block_table[b, t // PS] * PS + t % PS.
    scores = sm_scale * (q_nope . ckv + q_pe . kpe); returns out [B, H, R] (q's dtype) = softmax(scores) . ckv
    and lse float32 [B, H] = logsumexp(scores) (natural log). A row with seq_lens 0 gives (0, -inf).
    float64 inputs (the reference / gradcheck precision) compute in float64 and return a float64 lse.
    Differentiable in q_nope, q_pe, ckv_cache and kpe_cache.
    """
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)
    T = int(seq_lens.max()) if seq_lens.numel() else 0  # CPU: reading lengths is free; gather only what is used
    slots, valid = decode_slots(block_table, seq_lens, ckv_cache.shape[1], T)
    return attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale)


def _decode_all_slots(block_table, seq_lens, page_size):
    """Slots over the block table's whole capacity: a static width (no length read, no host sync)."""
    return decode_slots(block_table, seq_lens, page_size, block_table.shape[1] * page_size)


@decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)
    B, H, _ = q_nope.shape
    # contiguous, like the real impls (not empty_like: q_nope is often a transposed view after absorption)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty((B, H), dtype=C.lse_dtype(q_nope.dtype))


@decode.register_kernel("cuda")
def _(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale):
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)
    if q_nope.dtype == torch.float64:  # no kernel computes in float64: the reference, at a static width
        slots, valid = _decode_all_slots(block_table, seq_lens, ckv_cache.shape[1])
        return attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale)
    from ..kernels import dispatch

    return dispatch.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale)


def _decode_setup_context(ctx, inputs, output):
    q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale = inputs
    ctx.sm_scale = sm_scale
    ctx.save_for_backward(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens)


def _decode_backward(ctx, grad_out, grad_lse):
    q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens = ctx.saved_tensors
    slots, valid = _decode_all_slots(block_table, seq_lens, ckv_cache.shape[1])
    grads = attend_slots_backward(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, ctx.sm_scale, grad_out, grad_lse)
    return (*grads, None, None, None)


decode.register_autograd(_decode_backward, setup_context=_decode_setup_context)


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

    Shapes: q_nope [B, H, R], q_pe [B, H, P], ckv_cache [NP, PS, R], kpe_cache [NP, PS, P] (P >= 0),
    indices int32 [B, K] (flat slots page * PS + offset; -1 = ignored). Same math as `mla::decode` over the
    selected tokens; a row with no valid slot gives (0, -inf). Returns out [B, H, R], lse float32 [B, H]
    (float64 for float64 inputs). Differentiable in q_nope, q_pe, ckv_cache and kpe_cache.
    """
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)
    return _sparse_reference(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)


def _sparse_reference(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    slots = indices.long()
    return attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, slots >= 0, sm_scale)


@sparse_decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)
    B, H, _ = q_nope.shape
    # contiguous, like the real impls (not empty_like: q_nope is often a transposed view after absorption)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty((B, H), dtype=C.lse_dtype(q_nope.dtype))


@sparse_decode.register_kernel("cuda")
def _(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale):
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)
    if q_nope.dtype == torch.float64:  # no kernel computes in float64: the reference
        return _sparse_reference(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)
    from ..kernels import dispatch

    return dispatch.sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale)


def _sparse_setup_context(ctx, inputs, output):
    q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale = inputs
    ctx.sm_scale = sm_scale
    ctx.save_for_backward(q_nope, q_pe, ckv_cache, kpe_cache, indices)


def _sparse_backward(ctx, grad_out, grad_lse):
    q_nope, q_pe, ckv_cache, kpe_cache, indices = ctx.saved_tensors
    slots = indices.long()
    grads = attend_slots_backward(q_nope, q_pe, ckv_cache, kpe_cache, slots, slots >= 0, ctx.sm_scale, grad_out,
                                  grad_lse)
    return (*grads, None, None)


sparse_decode.register_autograd(_sparse_backward, setup_context=_sparse_setup_context)
