"""`mla::decode` and `mla::sparse_decode`: absorbed-MLA decode attention over the paged latent cache.

Registration choice: `torch.library.custom_op` + `register_kernel("cpu"/"cuda")`. Each op is one opaque
node to Inductor (an extern call), which is what we want for a hand-tuned attention kernel: Inductor has
nothing to fuse across it, and the CUDA impl launches Triton kernels with no host sync, so CUDA graphs
capture it as-is. The CPU impl is plain vectorized torch and is the reference the kernels are tested against.
"""

from __future__ import annotations

import torch

from .. import fp8
from . import _checks as C
from ._plans import Plans, dispatch_module
from ._registry import define

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------- validation
def query_tokens(q_nope: torch.Tensor) -> int:
    """S, the query tokens per request: q [B, S, H, *]; the 3-D form [B, H, *] is S = 1."""
    return q_nope.shape[1] if q_nope.dim() == 4 else 1


def _check_q(q_nope, q_pe, dtypes):
    for t, name, width in ((q_nope, "q_nope", "R"), (q_pe, "q_pe", "P")):
        C.check(isinstance(t, torch.Tensor), name, f"expected a Tensor, got {type(t).__name__}")
        C.check(t.dim() in (3, 4), name, f"expected 3 dims [B, H, {width}] or 4 dims [B, S, H, {width}] (S query "
                                         f"tokens per request), got shape {tuple(t.shape)}")
        C.check(t.dtype in dtypes, name, f"expected dtype in {dtypes}, got {t.dtype}")
    C.check(q_pe.dtype == q_nope.dtype, "q_pe", f"dtype {q_pe.dtype} differs from q_nope's {q_nope.dtype}")
    C.check(q_pe.dim() == q_nope.dim(), "q_pe", f"shape {tuple(q_pe.shape)} has {q_pe.dim()} dims, q_nope's "
                                                f"{tuple(q_nope.shape)} {q_nope.dim()}")
    if q_nope.dim() == 4:
        C.check(q_nope.shape[1] >= 1, "q_nope", f"needs S >= 1 query tokens per request, got shape "
                                                f"{tuple(q_nope.shape)}")
        C.check(q_pe.shape[1] == q_nope.shape[1], "q_pe",
                f"query tokens S = {q_pe.shape[1]} differ from q_nope's {q_nope.shape[1]}")
    lead = q_nope.dim() - 1
    C.check(q_pe.shape[:lead] == q_nope.shape[:lead], "q_pe",
            f"batch/heads {tuple(q_pe.shape[:lead])} differ from q_nope's {tuple(q_nope.shape[:lead])}")


def _check_cache_dtype(q_nope, ckv_cache, kpe_cache, ckv_scale):
    """ckv_cache in q's dtype, or the FP8 format (mla_compile/fp8.py) with its scales; kpe_cache in q's dtype."""
    C.check_ckv_scale(ckv_cache, ckv_scale)
    C.check(fp8.is_fp8(ckv_cache) or ckv_cache.dtype == q_nope.dtype, "ckv_cache",
            f"dtype {ckv_cache.dtype} differs from q_nope's {q_nope.dtype}")
    C.check(kpe_cache.dtype == q_nope.dtype, "kpe_cache",
            f"dtype {kpe_cache.dtype} differs from q_nope's {q_nope.dtype}")


def _check_lens(block_table, seq_lens, B: int, S: int) -> None:
    """seq_lens int32 [B] (causal: token j sees seq_lens[b] - S + 1 + j tokens), or with S query tokens an int32
    [B, S] table of each query token's limit."""
    if isinstance(seq_lens, torch.Tensor) and seq_lens.dim() == 2:
        C.check_tensor(seq_lens, "seq_lens", 2, torch.int32)
        C.check(tuple(seq_lens.shape) == (B, S), "seq_lens", f"a table of per-query-token limits must be [B, S] = "
                                                             f"{(B, S)}, got {tuple(seq_lens.shape)}")
        C.check_block_table(block_table, seq_lens[:, 0], B)
    else:
        C.check_block_table(block_table, seq_lens, B)


@C.once_per_signature
def check_decode_metadata(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                          dtypes=C.FLOAT_DTYPES, ckv_scale=None) -> tuple[int, int]:
    """Shapes, dtypes, devices of a decode call (no data read); returns (num_pages, page_size).
    `dtypes`: the q / cache dtypes the caller takes (mla::decode adds float64; DCP's lse packing does not);
    ckv_cache may also be FP8 with its `ckv_scale` (mla_compile/fp8.py)."""
    _check_q(q_nope, q_pe, dtypes)
    B, R = q_nope.shape[0], q_nope.shape[-1]
    num_pages, page_size = C.check_paged_cache(ckv_cache, kpe_cache, R, q_pe.shape[-1], dtypes, fp8_ok=True)
    _check_cache_dtype(q_nope, ckv_cache, kpe_cache, ckv_scale)
    if q_nope.dim() == 4:
        _check_lens(block_table, seq_lens, B, q_nope.shape[1])
    else:
        C.check_block_table(block_table, seq_lens, B)
    C.check_scale(sm_scale)
    C.check_same_device(dict(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv_cache, kpe_cache=kpe_cache,
                             block_table=block_table, seq_lens=seq_lens))
    return num_pages, page_size


def check_query_lens(seq_lens, S: int) -> None:
    """Values (where checks read them): with S > 1 query tokens a request's length counts its S new tokens, so it
    is 0 (an empty request: every row empty) or >= S."""
    if S == 1 or C.is_fake(seq_lens) or not C.data_checks_enabled(seq_lens.device) or not seq_lens.numel():
        return
    short = (seq_lens > 0) & (seq_lens < S)
    if bool(short.any()):
        C.fail("seq_lens", f"with S = {S} query tokens per request a length counts the S new tokens (already in the "
                           f"cache): it must be 0 or >= {S}, got {int(seq_lens[short][0])}")


def _check_limits_data(seq_lens) -> None:
    """A [B, S] limits table: >= 0 and non-decreasing over the query tokens (a later token sees no less)."""
    if C.is_fake(seq_lens) or not C.data_checks_enabled(seq_lens.device) or not seq_lens.numel():
        return
    lo = int(seq_lens.min())
    C.check(lo >= 0, "seq_lens", f"per-query-token limits must be >= 0, got {lo}")
    C.check(bool((seq_lens[:, 1:] >= seq_lens[:, :-1]).all()), "seq_lens",
            "per-query-token limits must be non-decreasing over the query tokens (causal)")


@C.once_per_signature
def check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale=None):
    num_pages, page_size = check_decode_metadata(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                                 C.REFERENCE_DTYPES, ckv_scale)
    if seq_lens.dim() == 2:
        _check_limits_data(seq_lens)
        seq_lens = seq_lens[:, -1]  # non-decreasing (checked where values are read): the last token sees the most
    else:
        check_query_lens(seq_lens, query_tokens(q_nope))
    C.check_block_table_data(block_table, seq_lens, num_pages, page_size)


@C.once_per_signature
def check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale=None):
    _check_q(q_nope, q_pe, C.REFERENCE_DTYPES)
    num_pages, page_size = C.check_paged_cache(ckv_cache, kpe_cache, q_nope.shape[-1], q_pe.shape[-1],
                                               C.REFERENCE_DTYPES, fp8_ok=True)
    _check_cache_dtype(q_nope, ckv_cache, kpe_cache, ckv_scale)
    C.check_tensor(indices, "indices", q_nope.dim() - 1, torch.int32)  # [B, K], or [B, S, K] with S query tokens
    C.check_dim(indices, "indices", 0, q_nope.shape[0], "the batch size")
    if q_nope.dim() == 4:
        C.check_dim(indices, "indices", 1, q_nope.shape[1], "q_nope's query tokens S")
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


def merges_as_view(*tensors: torch.Tensor, dim: int) -> bool:
    """Whether merging dims dim and dim + 1 of every tensor (S query tokens folded into rows or requests) is a view
    of it: a plan may then take the tensor as it is, its kernels reading it by the merged strides."""
    return all(t.shape[dim] == 1 or t.shape[dim + 1] == 1 or t.stride(dim) == t.shape[dim + 1] * t.stride(dim + 1)
               for t in tensors)


def query_limits(seq_lens: torch.Tensor, S: int) -> torch.Tensor:
    """int32 [B, S]: the tokens query token j of each request sees, seq_lens[b] - S + 1 + j (seq_lens counts the S
    new tokens; <= 0 for a length-0 request: nothing). A [B, S] seq_lens is such a table already. Device ops only
    (no host sync): DCP derives its per-rank limits from these (ops/dcp.py)."""
    if seq_lens.dim() == 2:
        return seq_lens
    return seq_lens[:, None] + torch.arange(1 - S, 1, dtype=seq_lens.dtype, device=seq_lens.device)


def multi_token_slots(block_table: torch.Tensor, limits: torch.Tensor, page_size: int, num_tokens: int):
    """(slots int64 [B, T], valid bool [B, T]: some query token sees the token, seen bool [B, S, T]: query token j
    sees it) for per-query-token limits [B, S]."""
    seen = torch.arange(num_tokens, device=limits.device) < limits.long()[..., None]
    return token_slots(block_table, page_size, num_tokens), seen.any(1), seen


def _slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """[NP, PS, D] -> [NP * PS, D] by explicit sizes: reshape(-1, D) is ambiguous for a rope-less D = 0."""
    return cache.reshape(cache.shape[0] * cache.shape[1], cache.shape[2])


def _gather_slots(ckv_cache, kpe_cache, slots, valid, dtype, ckv_scale=None):
    """(safe slots, ckv [B, T, R], kpe [B, T, P]) in `dtype`; masked tokens read slot 0 and are zeroed.
    P = 0 (rope-less MLA) gives kpe [B, T, 0], whose products below are exactly 0. An FP8 ckv_cache is read as
    fp8.dequantize(values, ckv_scale) (the format's definition), in `dtype`."""
    safe = torch.where(valid, slots, torch.zeros_like(slots))
    keep = valid[..., None]
    rows = _slot_rows(ckv_cache)[safe]
    rows = rows.to(dtype) if ckv_scale is None else fp8.dequantize(rows, _slot_rows(ckv_scale)[safe], dtype)
    # zero masked tokens: unused slots may hold anything (NaN), and 0-probability * NaN is still NaN
    ckv = torch.where(keep, rows, 0.0)
    kpe = torch.where(keep, _slot_rows(kpe_cache)[safe].to(dtype), 0.0)
    return safe, ckv, kpe


def _softmax_over_slots(q_nope, q_pe, ckv, kpe, seen, sm_scale):
    """(probs [B, (S,) H, T], lse [B, (S,) H]) of scores = sm_scale * (q_nope . ckv + q_pe . kpe) for q [B, H, *]
    or [B, S, H, *]; `seen` [B, (S,) T] masks tokens per request (and query token). A row with no token it sees
    gives probs 0 and lse -inf."""
    scores = sm_scale * (torch.einsum("b...hr,btr->b...ht", q_nope, ckv)
                         + torch.einsum("b...hp,btp->b...ht", q_pe, kpe))
    scores = scores.masked_fill(~seen.unsqueeze(-2), _NEG_INF)
    lse = torch.logsumexp(scores, dim=-1)  # -inf for rows with no valid slot
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    return probs, lse


def attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale, seen=None, ckv_scale=None):
    """Attention of every head over the listed slots; `valid` [B, T] masks slots out; `seen` [B, S, T] (q
    [B, S, H, *]: S query tokens) masks them per query token (default: valid). (out, lse); the math runs in
    C.lse_dtype (float32, float64 for float64 inputs). ckv_scale: an FP8 ckv_cache's scales."""
    dt = C.lse_dtype(q_nope.dtype)
    _, ckv, kpe = _gather_slots(ckv_cache, kpe_cache, slots, valid, dt, ckv_scale)
    probs, lse = _softmax_over_slots(q_nope.to(dt), q_pe.to(dt), ckv, kpe, valid if seen is None else seen, sm_scale)
    out = torch.einsum("b...ht,btr->b...hr", probs, ckv)
    return out.to(q_nope.dtype).contiguous(), lse.contiguous()


def attend_slots_backward(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale, grad_out, grad_lse, seen=None,
                          ckv_scale=None):
    """Gradients of `attend_slots` w.r.t. (q_nope, q_pe, ckv_cache, kpe_cache), the softmax recomputed.

    With p = softmax(s), out = p . v and lse = logsumexp(s): ds = p * (dout . v - dout . out + dlse);
    dq = sm_scale * ds . k; dk = sm_scale * ds^T . q; dv = p^T . dout. Token gradients are summed into their
    slots (a slot listed twice gets both) over heads and query tokens; masked tokens, empty rows and unused slots
    get exactly 0. Plain torch with static shapes (no data-dependent size), so AOTAutograd traces it into the
    backward graph. An FP8 ckv_cache (ckv_scale given) is not differentiable: its gradient is None.
    """
    dt = C.lse_dtype(q_nope.dtype)
    qn, qp = q_nope.to(dt), q_pe.to(dt)
    safe, ckv, kpe = _gather_slots(ckv_cache, kpe_cache, slots, valid, dt, ckv_scale)
    probs, _ = _softmax_over_slots(qn, qp, ckv, kpe, valid if seen is None else seen, sm_scale)
    out = torch.einsum("b...ht,btr->b...hr", probs, ckv)
    g_out = torch.zeros_like(out) if grad_out is None else grad_out.to(dt)
    g_lse = torch.zeros_like(out[..., 0]) if grad_lse is None else grad_lse.to(dt)
    d_probs = torch.einsum("b...hr,btr->b...ht", g_out, ckv)
    d_scores = probs * (d_probs - (g_out * out).sum(-1, keepdim=True) + g_lse[..., None])
    d_q_nope = sm_scale * torch.einsum("b...ht,btr->b...hr", d_scores, ckv)
    d_q_pe = sm_scale * torch.einsum("b...ht,btp->b...hp", d_scores, kpe)
    d_ckv = (sm_scale * torch.einsum("b...ht,b...hr->btr", d_scores, qn)
             + torch.einsum("b...ht,b...hr->btr", probs, g_out))
    d_kpe = sm_scale * torch.einsum("b...ht,b...hp->btp", d_scores, qp)

    def to_slots(d_tok, cache):  # [B, T, D] -> cache-shaped sums per slot
        # masked tokens point at slot 0: keep whatever they carry (0 * a non-finite upstream grad) out of it
        d_tok = torch.where(valid[..., None], d_tok, 0.0)
        flat = d_tok.new_zeros(cache.shape[0] * cache.shape[1], cache.shape[2])
        rows = d_tok.reshape(d_tok.shape[0] * d_tok.shape[1], cache.shape[2])  # explicit: D may be 0 (no rope)
        return flat.index_add(0, safe.reshape(-1), rows).view(cache.shape).to(cache.dtype)

    return (d_q_nope.to(q_nope.dtype), d_q_pe.to(q_pe.dtype),
            None if ckv_scale is not None else to_slots(d_ckv, ckv_cache), to_slots(d_kpe, kpe_cache))


def _decode_on_slots(q_nope, ckv_cache, block_table, seq_lens, num_tokens):
    """`mla::decode`'s definition over the first num_tokens logical tokens: (slots, valid, seen) for
    `attend_slots`; seen is None for one query token (q [B, H, *], valid masks each request)."""
    if q_nope.dim() == 3:
        return (*decode_slots(block_table, seq_lens, ckv_cache.shape[1], num_tokens), None)
    limits = query_limits(seq_lens, q_nope.shape[1])
    return multi_token_slots(block_table, limits, ckv_cache.shape[1], num_tokens)


def _longest(seq_lens) -> int:
    """The most tokens any query token sees (CPU: reading lengths is free; gather only what is used)."""
    return max(int(seq_lens.max()), 0) if seq_lens.numel() else 0


# --------------------------------------------------------------------------------------------- mla::decode
@define(
    "mla::decode",
    mutates_args=(),
    device_types="cpu",
    tags=(torch.Tag.flexible_layout,),  # q may come in any batch/head strides (a permuted bmm output)
    schema="(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor block_table, "
           "Tensor seq_lens, float sm_scale, Tensor? ckv_scale=None) -> (Tensor, Tensor)",
)
def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale=None):
    """Absorbed-MLA decode attention over a paged latent cache, S >= 1 query tokens per request.

    Shapes: q_nope [B, H, R], q_pe [B, H, P] (R = kv_lora_rank >= 1, P = rope dim >= 0); ckv_cache [NP, PS, R],
    kpe_cache [NP, PS, P] (NP pages of PS tokens); block_table int32 [B, MP]; seq_lens int32 [B].
    P = 0 is rope-less MLA (q_pe [B, H, 0], kpe_cache [NP, PS, 0]): scores = sm_scale * q_nope . ckv.
    Token t < seq_lens[b] of request b sits at slot block_table[b, t // PS] * PS + t % PS.
    scores = sm_scale * (q_nope . ckv + q_pe . kpe); returns out [B, H, R] (q's dtype) = softmax(scores) . ckv
    and lse float32 [B, H] = logsumexp(scores) (natural log). A row with seq_lens 0 gives (0, -inf).

    S query tokens per request (MTP, speculative verification): q_nope [B, S, H, R], q_pe [B, S, H, P] ->
    out [B, S, H, R], lse [B, S, H]. seq_lens counts the S new tokens (already written into the cache): query
    token j of request b sees tokens t < seq_lens[b] - S + 1 + j, and every length is 0 (an empty request) or
    >= S. Or seq_lens int32 [B, S] gives each query token's limit itself (>= 0, non-decreasing in j: DCP's
    per-rank counts). A row whose limit is <= 0 gives (0, -inf). The 3-D form is S = 1.

    FP8 latent cache (mla_compile/fp8.py): ckv_cache float8_e4m3fn [NP, PS, R] (R a multiple of 128) with
    ckv_scale float32 [NP, PS, R / 128] (required then, None otherwise); the latent is read as
    fp8.dequantize(ckv_cache, ckv_scale) exactly; q, kpe_cache and out keep q's dtype.

    float64 inputs (the reference / gradcheck precision) compute in float64 and return a float64 lse.
    Differentiable in q_nope, q_pe, ckv_cache (not an FP8 one) and kpe_cache (any S).
    """
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale)
    slots, valid, seen = _decode_on_slots(q_nope, ckv_cache, block_table, seq_lens, _longest(seq_lens))
    return attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale, seen, ckv_scale)


def _decode_all_slots(q_nope, ckv_cache, block_table, seq_lens):
    """(slots, valid, seen) over the block table's whole capacity: a static width (no length read, no host sync)."""
    return _decode_on_slots(q_nope, ckv_cache, block_table, seq_lens, block_table.shape[1] * ckv_cache.shape[1])


@decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale=None):
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale)
    # contiguous, like the real impls (not empty_like: q_nope is often a transposed view after absorption)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:-1], dtype=C.lse_dtype(q_nope.dtype))


_DECODE_PLANS = Plans()
_SPARSE_PLANS = Plans()


def _make_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale):
    """(plan, keep) for `Plans.run`: q [B, H, *] -> kernels/dispatch.py's plan; q [B, S, H, *] -> `_folded_plan`."""
    if q_nope.dim() == 4:
        return _folded_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale)
    return dispatch_module().decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                         ckv_scale=ckv_scale)


@decode.register_kernel("cuda")
def _(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale=None):
    # a kernel's dtype (one or S query tokens): a plan per signature (ops/_plans.py), checked when it is made
    if q_nope.dtype != torch.float64:
        return _DECODE_PLANS.run((q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, ckv_scale), (sm_scale,),
                                 check_decode_args, _make_decode_plan,
                                 (q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale))
    # no kernel computes in float64: the reference, at a static width
    check_decode_args(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale)
    slots, valid, seen = _decode_all_slots(q_nope, ckv_cache, block_table, seq_lens)
    return attend_slots(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, sm_scale, seen, ckv_scale)


def _folded_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale=None):
    """(plan, keep): q [B, S, H, *] through the kernels' plan for rows: S folded into them ([B, S*H, *], row j*H + h),
    n_query = S; S = 1 is the one-token call (its limits column as the lengths). Made once per signature like the
    one-token plan (a plan made per call cost ~20x the planned call's host time: benchmarks/lab/host_cpu.py). Where
    the fold is a view of q (its strides allow) our kernels' plans take q as it is and allocate the outputs as
    [B, S, H, R] / [B, S, H]: four view ops a call less, 13.6 -> 8.8 us at S = 2 on the CPU proxy
    (benchmarks/lab/host_cpu.py), what one query token costs; else the plan reshapes q and views the outputs back
    each call (kernels/dispatch.py `unfolded`)."""
    B, S, H, R = q_nope.shape
    rows, outer = (B, S * H), (B, S, H, R)
    first_limit = S == 1 and seq_lens.dim() == 2  # one query token's [B, 1] limits: the lengths themselves
    dispatch = dispatch_module()
    folds = merges_as_view(q_nope, q_pe, dim=1)
    inner, keep = dispatch.decode_plan(q_nope.reshape(*rows, R), q_pe.reshape(*rows, q_pe.shape[-1]), ckv_cache,
                                       kpe_cache, block_table, seq_lens[:, 0] if first_limit else seq_lens, sm_scale,
                                       n_query=S, ckv_scale=ckv_scale,
                                       outer=outer if folds and not first_limit else None)
    return (inner if folds and not first_limit else dispatch.unfolded(inner, outer, first_limit)), keep


def _decode_setup_context(ctx, inputs, output):
    q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, ckv_scale = inputs
    ctx.sm_scale = sm_scale
    ctx.save_for_backward(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, ckv_scale)


def _decode_backward(ctx, grad_out, grad_lse):
    q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, ckv_scale = ctx.saved_tensors
    slots, valid, seen = _decode_all_slots(q_nope, ckv_cache, block_table, seq_lens)
    grads = attend_slots_backward(q_nope, q_pe, ckv_cache, kpe_cache, slots, valid, ctx.sm_scale, grad_out, grad_lse,
                                  seen, ckv_scale)
    return (*grads, None, None, None, None)


decode.register_autograd(_decode_backward, setup_context=_decode_setup_context)


# -------------------------------------------------------------------------------------- mla::sparse_decode
@define(
    "mla::sparse_decode",
    mutates_args=(),
    device_types="cpu",
    tags=(torch.Tag.flexible_layout,),  # q may come in any batch/head strides (a permuted bmm output)
    schema="(Tensor q_nope, Tensor q_pe, Tensor ckv_cache, Tensor kpe_cache, Tensor indices, float sm_scale, "
           "Tensor? ckv_scale=None) -> (Tensor, Tensor)",
)
def sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale=None):
    """Absorbed-MLA decode attention over the listed PHYSICAL slots only (DSA top-k attention).

    Shapes: q_nope [B, H, R], q_pe [B, H, P], ckv_cache [NP, PS, R], kpe_cache [NP, PS, P] (P >= 0),
    indices int32 [B, K] (flat slots page * PS + offset; -1 = ignored). Same math as `mla::decode` over the
    selected tokens; a row with no valid slot gives (0, -inf). Returns out [B, H, R], lse float32 [B, H]
    (float64 for float64 inputs). Differentiable in q_nope, q_pe, ckv_cache and kpe_cache.
    S query tokens per request: q_nope [B, S, H, R], q_pe [B, S, H, P], indices int32 [B, S, K] (each query token
    its own top-k, causal by construction) -> out [B, S, H, R], lse [B, S, H].
    An FP8 ckv_cache with its ckv_scale as for `mla::decode`.
    """
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale)
    return _sparse_reference(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale)


def _tokens_as_batch(q_nope, q_pe, indices):
    """[B, S, H, *] queries with [B, S, K] index lists -> [B*S, H, *] / [B*S, K]: with an index list per query token
    the tokens share no tile, so each is a request of its own. The 3-D form as it is."""
    if q_nope.dim() == 3:
        return q_nope, q_pe, indices
    rows = q_nope.shape[0] * q_nope.shape[1]
    return (q_nope.reshape(rows, *q_nope.shape[2:]), q_pe.reshape(rows, *q_pe.shape[2:]),
            indices.reshape(rows, indices.shape[-1]))


def _unfold(like, out, lse):
    """Results of `_tokens_as_batch`'d inputs back to like's [B, S, H, *] (the 3-D form as they are)."""
    return out.view(like.shape), lse.view(like.shape[:-1])


def _sparse_reference(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale=None):
    qn, qp, idx = _tokens_as_batch(q_nope, q_pe, indices)
    slots = idx.long()
    return _unfold(q_nope, *attend_slots(qn, qp, ckv_cache, kpe_cache, slots, slots >= 0, sm_scale,
                                         ckv_scale=ckv_scale))


@sparse_decode.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale=None):
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale)
    # contiguous, like the real impls (not empty_like: q_nope is often a transposed view after absorption)
    return q_nope.new_empty(q_nope.shape), q_nope.new_empty(q_nope.shape[:-1], dtype=C.lse_dtype(q_nope.dtype))


@sparse_decode.register_kernel("cuda")
def _(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale=None):
    if q_nope.dtype != torch.float64:  # as mla::decode's impl: a plan per signature (one or S query tokens)
        # the plan's arguments (`dispatch.sparse_decode_plan`): the lengths' place empty
        return _SPARSE_PLANS.run((q_nope, q_pe, ckv_cache, kpe_cache, indices, None, ckv_scale), (sm_scale,),
                                 check_sparse_args, _make_sparse_plan,
                                 (q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale))
    # no kernel computes in float64: the reference
    check_sparse_args(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale)
    return _sparse_reference(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale)


def _make_sparse_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale):
    """(plan, keep) for `Plans.run`: q [B, H, *] -> kernels/dispatch.py's plan; q [B, S, H, *] with [B, S, K] index
    lists -> the same over [B*S, H, *] (`_tokens_as_batch`): where that fold is a view of each (their strides allow),
    the plan takes them as they are and gives out / lse in q's shape (no view a call, as `_folded_plan`); else its
    inputs reshaped and outputs viewed back each call."""
    dispatch = dispatch_module()
    if q_nope.dim() == 3:
        return dispatch.sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale)
    qn, qp, idx = _tokens_as_batch(q_nope, q_pe, indices)
    if merges_as_view(q_nope, q_pe, indices, dim=0):
        return dispatch.sparse_decode_plan(qn, qp, ckv_cache, kpe_cache, idx, sm_scale, ckv_scale,
                                           outer=tuple(q_nope.shape))
    inner, keep = dispatch.sparse_decode_plan(qn, qp, ckv_cache, kpe_cache, idx, sm_scale, ckv_scale)
    out_shape, lse_shape = q_nope.shape, q_nope.shape[:-1]

    def plan(qn, qp, ckv, kpe, idx, lens=None, scale=None):
        qn, qp, idx = _tokens_as_batch(qn, qp, idx)
        out, lse = inner(qn, qp, ckv, kpe, idx, None, scale)
        return out.view(out_shape), lse.view(lse_shape)

    return plan, keep


def _sparse_setup_context(ctx, inputs, output):
    q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale = inputs
    ctx.sm_scale = sm_scale
    ctx.save_for_backward(q_nope, q_pe, ckv_cache, kpe_cache, indices, ckv_scale)


def _sparse_backward(ctx, grad_out, grad_lse):
    q_nope, q_pe, ckv_cache, kpe_cache, indices, ckv_scale = ctx.saved_tensors
    qn, qp, idx = _tokens_as_batch(q_nope, q_pe, indices)
    slots = idx.long()
    fold = (lambda g: g) if q_nope.dim() == 3 else (lambda g: None if g is None else g.reshape(-1, *g.shape[2:]))
    d_qn, d_qp, d_ckv, d_kpe = attend_slots_backward(qn, qp, ckv_cache, kpe_cache, slots, slots >= 0, ctx.sm_scale,
                                                     fold(grad_out), fold(grad_lse), ckv_scale=ckv_scale)
    return d_qn.view(q_nope.shape), d_qp.view(q_pe.shape), d_ckv, d_kpe, None, None, None


sparse_decode.register_autograd(_sparse_backward, setup_context=_sparse_setup_context)
