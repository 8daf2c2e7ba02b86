"""`mla::fused_linear`: x @ W_i^T for several bias-free weights that share x, as one op.

The decode step of an MLA layer reads q_a_proj and kv_a_proj_with_mqa (and an MLP's gate_proj and up_proj) with
the same few rows of x. Two cuBLAS launches of a narrow weight each pay the fixed cost of a small GEMM (~5.5 us
on the H200, benchmarks/linear_sweep.py); the CUDA impl runs a pair as one Triton launch over both weights'
rows (kernels/linear.py; K split over more programs when the rows are few) when x has at most 16 rows, without
concatenating (copying) the weights. Any other case, and the CPU impl, is `F.linear` per weight: the op
computes exactly what the unfused graph did.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _checks as C


def check_fused_linear_args(x, weights):
    C.check(isinstance(x, torch.Tensor), "x", f"expected a Tensor, got {type(x).__name__}")
    C.check(x.dim() >= 1 and x.is_floating_point(), "x",
            f"expected a float tensor [..., K], got shape {tuple(x.shape)} dtype {x.dtype}")
    C.check(len(weights) >= 1, "weights", "needs at least one weight")
    for i, w in enumerate(weights):
        C.check_tensor(w, f"weights[{i}]", 2, x.dtype)
        C.check_dim(w, f"weights[{i}]", 1, x.shape[-1], "x.shape[-1] (K)")
    C.check_same_device(dict(x=x, **{f"weights[{i}]": w for i, w in enumerate(weights)}))


@torch.library.custom_op(
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
    check_fused_linear_args(x, weights)
    from ..kernels import dispatch

    return dispatch.fused_linear(x, weights)


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
