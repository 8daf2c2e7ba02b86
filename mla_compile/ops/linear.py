"""`mla::fused_linear`: x @ W_i^T for several bias-free weights that share x, as one op;
`mla::linear_partials`: the same product as split-K partial sums, for the graph to add up where it is used; and
`mla::per_head_linear`: one weight per head (the absorbed MLA projections W_UK / W_UV).

The decode step of an MLA layer reads q_a_proj and kv_a_proj_with_mqa (and an MLP's gate_proj and up_proj) with
the same few rows of x. Two cuBLAS launches of a narrow weight each pay the fixed cost of a small GEMM (~5.5 us
on the H200, benchmarks/linear_sweep.py); the CUDA impl runs a pair as one Triton launch over both weights'
rows (kernels/linear.py; K split over more programs when the rows are few) when x has at most 16 rows, without
concatenating (copying) the weights. Any other case, and the CPU impl, is `F.linear` per weight: the op
computes exactly what the unfused graph did.

With few rows and a long K the kernel splits K over more programs; as `fused_linear` it then adds the fp32
partials in the same launch on the legacy default stream (the last program of each row block: eager calls) and
in a second launch elsewhere (CUDA-graph capture, side streams; kernels/linear.py `small_m_plan`).
`linear_partials` returns them instead, so the pass (passes/fused_linear.py) can write their sum as pointwise adds
that Inductor fuses into the RMSNorm / residual add that reads the output anyway: one launch and one launch gap
less per projection under CUDA graphs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.few_token import FEW_TOKEN_ROWS, K_ALIGN, few_token_rows, split_width  # noqa: F401 (re-exported)
from . import _checks as C
from ._plans import Plans, dispatch_plan
from ._registry import define

# one plan per call signature for each op's CUDA impl (ops/_plans.py)
_FUSED_PLANS, _PARTIALS_PLANS, _PER_HEAD_PLANS = Plans(), Plans(), Plans()


@C.once_per_signature
def check_fused_linear_args(x, weights):
    C.check(isinstance(x, torch.Tensor), "x", f"expected a Tensor, got {type(x).__name__}")
    C.check(x.dim() >= 1 and x.is_floating_point(), "x",
            f"expected a float tensor [..., K], got shape {tuple(x.shape)} dtype {x.dtype}")
    C.check(len(weights) >= 1, "weights", "needs at least one weight")
    for i, w in enumerate(weights):
        C.check_tensor(w, f"weights[{i}]", 2, x.dtype)
        C.check_dim(w, f"weights[{i}]", 1, x.shape[-1], "x.shape[-1] (K)")
    C.check_same_device(dict(x=x, **{f"weights[{i}]": w for i, w in enumerate(weights)}))


@define(
    "mla::fused_linear",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor x, Tensor[] weights) -> Tensor[]",
)
def fused_linear(x, weights):
    """[x @ W^T for W in weights] (nn.Linear without bias, every W read once per call).

    Shapes: x [..., K] (float), weights: each [N_i, K] in x's dtype; returns [..., N_i] each, in x's dtype.
    """
    check_fused_linear_args(x, weights)
    return [F.linear(x, w) for w in weights]


@fused_linear.register_fake
def _(x, weights):
    check_fused_linear_args(x, weights)
    return [x.new_empty((*x.shape[:-1], w.shape[0])) for w in weights]


@fused_linear.register_kernel("cuda")
def _(x, weights):
    return _FUSED_PLANS.run((x, *weights), (), check_fused_linear_args, _make_fused_plan, (x, weights))


_make_fused_plan = dispatch_plan("fused_linear_plan")


def _setup_context(ctx, inputs, output):
    x, weights = inputs
    ctx.save_for_backward(x, *weights)


def _backward(ctx, grads):
    # the linears' own gradients, so a graph that trains through a fused pair stays correct
    x, *weights = ctx.saved_tensors
    grads = [torch.zeros((*x.shape[:-1], w.shape[0]), dtype=x.dtype, device=x.device) if g is None else g
             for g, w in zip(grads, weights)]
    grad_x = sum(g @ w for g, w in zip(grads, weights))
    x2 = x.reshape(-1, x.shape[-1])
    grad_ws = [g.reshape(-1, g.shape[-1]).T @ x2 for g in grads]
    return grad_x, grad_ws


fused_linear.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------- linear_partials
def split_ranges(K: int, splits: int) -> list[tuple[int, int]]:
    """The K range of each partial: `splits` ranges of `split_width(K, splits)`, the last ones short or empty."""
    w = split_width(K, splits)
    return [(min(s * w, K), min((s + 1) * w, K)) for s in range(splits)]


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 for half / bf16 / fp32, fp64 stays fp64


@C.once_per_signature
def check_linear_partials_args(x, weights, splits):
    C.check(isinstance(x, torch.Tensor), "x", f"expected a Tensor, got {type(x).__name__}")
    C.check(x.dim() == 2 and x.is_floating_point(), "x",
            f"expected a float tensor [M, K], got shape {tuple(x.shape)} dtype {x.dtype}")
    C.check(C.is_int(splits) and 1 <= splits <= 64, "splits", f"expected an int in [1, 64], got {splits!r}")
    check_fused_linear_args(x, weights)


def _partials(x, weights, splits):
    """The definition, in torch ops on x's device (the CPU impl, and the CUDA impl outside the kernel's range)."""
    W = torch.cat(list(weights)) if len(weights) > 1 else weights[0]
    acc = partial_dtype(x.dtype)
    out = x.new_zeros((splits, x.shape[0], W.shape[0]), dtype=acc)
    for s, (lo, hi) in enumerate(split_ranges(x.shape[1], splits)):
        if lo < hi:
            out[s] = x[:, lo:hi].to(acc) @ W[:, lo:hi].to(acc).T
    return out


@define(
    "mla::linear_partials",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor x, Tensor[] weights, int splits) -> Tensor",
)
def linear_partials(x, weights, splits):
    """Split-K partial products of x @ [W_0 | W_1 | ...]^T, summed over dim 0 by the caller.

    Shapes: x [M, K] (float), weights: each [N_i, K] in x's dtype, splits >= 1; returns [splits, M, sum N_i] in
    float32 (float64 for float64 x). Partial s covers K range `split_ranges(K, splits)[s]` (whole multiples of
    K_ALIGN = 128, empty ranges give zeros); columns are W_0's rows, then W_1's, ...
    """
    check_linear_partials_args(x, weights, splits)
    return _partials(x, weights, splits)


@linear_partials.register_fake
def _(x, weights, splits):
    check_linear_partials_args(x, weights, splits)
    return x.new_empty((splits, x.shape[0], sum(w.shape[0] for w in weights)), dtype=partial_dtype(x.dtype))


@linear_partials.register_kernel("cuda")
def _(x, weights, splits):
    return _PARTIALS_PLANS.run((x, *weights), (splits,), check_linear_partials_args, _partials_plan,
                               (x, weights, splits))


def _partials_plan(x, weights, splits):
    if not few_token_rows(x.shape[0], x.dtype):  # outside the few-token kernel's range: the definition
        return (lambda x, *weights: _partials(x, list(weights), splits)), True
    from ..kernels import dispatch

    return dispatch.linear_partials_plan(x, weights, splits)


def _partials_setup_context(ctx, inputs, output):
    x, weights, splits = inputs
    ctx.splits = splits
    ctx.save_for_backward(x, *weights)


def _partials_backward(ctx, grad):
    x, *weights = ctx.saved_tensors
    grad_x = torch.zeros_like(x)
    grad_ws = [torch.zeros_like(w) for w in weights]
    for s, (lo, hi) in enumerate(split_ranges(x.shape[1], ctx.splits)):
        col = 0
        for w, gw in zip(weights, grad_ws):
            g = grad[s, :, col:col + w.shape[0]]
            grad_x[:, lo:hi] += (g @ w[:, lo:hi].to(g.dtype)).to(x.dtype)
            gw[:, lo:hi] = (g.T @ x[:, lo:hi].to(g.dtype)).to(w.dtype)
            col += w.shape[0]
    return grad_x, grad_ws, None


linear_partials.register_autograd(_partials_backward, setup_context=_partials_setup_context)


# --------------------------------------------------------------------------------------------- per_head_linear
@C.once_per_signature
def check_per_head_linear_args(x, weight):
    C.check(isinstance(x, torch.Tensor), "x", f"expected a Tensor, got {type(x).__name__}")
    C.check(x.dim() == 3 and x.is_floating_point(), "x",
            f"expected a float tensor [B, H, K], got shape {tuple(x.shape)} dtype {x.dtype}")
    C.check_tensor(weight, "weight", 3, x.dtype)
    C.check_dim(weight, "weight", 0, x.shape[1], "x.shape[1] (heads H)")
    C.check_dim(weight, "weight", 2, x.shape[2], "x.shape[2] (K)")
    C.check_same_device(dict(x=x, weight=weight))


def _per_head(x, weight):
    """The definition in torch ops (the CPU impl, and the CUDA impl outside the kernel's range)."""
    return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1).contiguous()


@define(
    "mla::per_head_linear",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor x, Tensor weight) -> Tensor",
)
def per_head_linear(x, weight):
    """y[:, h] = x[:, h] @ weight[h]^T: a bias-free linear per head (MLA's absorbed W_UK / W_UV, read from
    kv_b_proj's weight as strided views).

    Shapes: x [B, H, K] (float, any strides), weight [H, N, K] in x's dtype (any strides: W_UK is a transposed
    view); returns [B, H, N] contiguous, in x's dtype. The layout the next op wants, where `bmm` over heads gives
    [H, B, N] and a transpose copy.
    """
    check_per_head_linear_args(x, weight)
    return _per_head(x, weight)


@per_head_linear.register_fake
def _(x, weight):
    check_per_head_linear_args(x, weight)
    return x.new_empty((x.shape[0], x.shape[1], weight.shape[1]))


@per_head_linear.register_kernel("cuda")
def _(x, weight):
    return _PER_HEAD_PLANS.run((x, weight), (), check_per_head_linear_args, _per_head_plan, (x, weight))


def _per_head_plan(x, weight):
    if not few_token_rows(x.shape[0], x.dtype):  # outside the few-token kernel's range: the definition
        return _per_head, True
    from ..kernels import dispatch

    return dispatch.per_head_linear_plan(x, weight)


def _per_head_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _per_head_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    grad_x = torch.einsum("bhn,hnk->bhk", grad, weight)
    grad_w = torch.einsum("bhn,bhk->hnk", grad, x)
    return grad_x, grad_w


per_head_linear.register_autograd(_per_head_backward, setup_context=_per_head_setup_context)

