"""`mla::expert_linear`: one bias-free linear per (token, expert) pair, each reading its expert's weight in place.

HF's "batched_mm" experts (what `generate()` switches MoE layers to for decode) gather the selected experts'
weights per pair, `W[expert_ids]` -> [S, O, I] with S = tokens x top_k, and then `bmm` them with the pairs'
activations. The gather is a full copy of every selected weight, written and read back: in a compiled 4-layer
DeepSeek-V3 decode step on the H200 (8 experts top-2, hidden 2048, batch 8) ~0.36 ms of 1.2 ms, and at the real
model's shapes (256 experts top-8, hidden 7168, batch 32) 15 GB per layer. This op computes the same product
reading weight[expert_ids[s]] where it lies (`passes/expert_gather.py` rewrites HF's form into it).

The weight is [E, O, I] (nn.Linear rows per expert) with any strides, so HF's transposed [E, I, O] experts
(`is_transposed`) are passed as `W.transpose(1, 2)`: one contract, no copy.
"""

from __future__ import annotations

import torch

from . import _checks as C
from ._plans import Plans
from ._registry import define

ID_DTYPES = (torch.int64, torch.int32)


@C.once_per_signature
def check_expert_linear_args(x, weight, expert_ids) -> None:
    C.check_tensor(x, "x", 2, C.REFERENCE_DTYPES)
    C.check_tensor(weight, "weight", 3, x.dtype)
    C.check_tensor(expert_ids, "expert_ids", 1, ID_DTYPES)
    C.check_dim(weight, "weight", 2, x.shape[1], "x.shape[1] (input features I)")
    C.check_dim(expert_ids, "expert_ids", 0, x.shape[0], "x.shape[0] (pairs S)")
    C.check_same_device(dict(x=x, weight=weight, expert_ids=expert_ids))


def check_expert_ids_data(expert_ids, num_experts: int) -> None:
    """Ids in [-E, E) (negative ids count from the end, as `weight[expert_ids]` reads them); reads values, so only
    where data checks are on (`_checks.data_checks_enabled`)."""
    if C.is_fake(expert_ids) or not C.data_checks_enabled(expert_ids.device) or expert_ids.numel() == 0:
        return
    lo, hi = int(expert_ids.min()), int(expert_ids.max())
    C.check(-num_experts <= lo and hi < num_experts, "expert_ids",
            f"ids must lie in [-{num_experts}, {num_experts}) (weight has {num_experts} experts), saw [{lo}, {hi}]")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32 for half / bf16 / fp32, fp64 stays fp64


def wrapped_ids(expert_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 ids in [0, E): negative ids count from the end, as indexing reads them."""
    ids = expert_ids.long()
    return torch.where(ids < 0, ids + num_experts, ids)


def _by_expert(x, weight, expert_ids):
    """The definition, each used expert read once (host loop over the experts present: the CPU impl)."""
    acc = acc_dtype(x.dtype)
    out = x.new_zeros((x.shape[0], weight.shape[1]), dtype=acc)
    ids = wrapped_ids(expert_ids, weight.shape[0])
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().squeeze(1)
        out[rows] = x[rows].to(acc) @ weight[e].to(acc).T
    return out.to(x.dtype)


def _gathered(x, weight, expert_ids):
    """The definition without a host sync (the CUDA impl for float64, which the Triton kernel does not take):
    HF's own gather + bmm, in the accumulation dtype."""
    acc = acc_dtype(x.dtype)
    selected = weight[wrapped_ids(expert_ids, weight.shape[0])].to(acc)
    return torch.bmm(selected, x.to(acc)[:, :, None])[:, :, 0].to(x.dtype)


@define(
    "mla::expert_linear",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor x, Tensor weight, Tensor expert_ids) -> Tensor",
)
def expert_linear(x, weight, expert_ids):
    """out[s] = weight[expert_ids[s]] @ x[s]: a bias-free linear per pair with its expert's weight, without
    gathering (copying) the weights.

    Shapes: x [S, I] (float16 / bfloat16 / float32 / float64), weight [E, O, I] in x's dtype (any strides: HF's
    transposed [E, I, O] experts go in as `W.transpose(1, 2)`), expert_ids [S] int64 or int32 in [-E, E)
    (negative ids count from the end, as `weight[expert_ids]` reads them); returns [S, O] contiguous, in x's dtype,
    accumulated in float32 (float64 for float64).
    """
    check_expert_linear_args(x, weight, expert_ids)
    check_expert_ids_data(expert_ids, weight.shape[0])
    return _by_expert(x, weight, expert_ids)


@expert_linear.register_fake
def _(x, weight, expert_ids):
    check_expert_linear_args(x, weight, expert_ids)
    return x.new_empty((x.shape[0], weight.shape[1]))


@expert_linear.register_kernel("cuda")
def _(x, weight, expert_ids):
    return _PLANS.run((x, weight, expert_ids), (), _check, _plan, (x, weight, expert_ids))


def _check(x, weight, expert_ids):
    check_expert_linear_args(x, weight, expert_ids)
    check_expert_ids_data(expert_ids, weight.shape[0])  # reads values only where data checks are on


def _plan(x, weight, expert_ids):
    if x.dtype not in C.FLOAT_DTYPES:  # float64: the kernel's dtypes are the half / single ones
        return _gathered, True
    from ..kernels import experts

    return experts.expert_linear_plan(x, weight, expert_ids), True


_PLANS = Plans()  # one plan per call signature (ops/_plans.py)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad):
    # the per-pair linears' own gradients, so a graph that trains through the rewrite stays correct
    x, weight, expert_ids = ctx.saved_tensors
    grad = grad.contiguous()
    grad_x = torch.ops.mla.expert_linear(grad, weight.transpose(1, 2), expert_ids)
    ids = wrapped_ids(expert_ids, weight.shape[0])
    grad_w = torch.zeros_like(weight).index_add_(0, ids, grad[:, :, None] * x[:, None, :])
    return grad_x, grad_w, None


expert_linear.register_autograd(_backward, setup_context=_setup_context)
