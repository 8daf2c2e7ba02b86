"""`mla::merge_states`: combine partial attention states (out_i, lse_i) by log-sum-exp.

This is the ONE home of the merge math: DCP ranks, split-KV stages and any foreign kernel's partials all
combine through it, in natural-log LSE.
"""

from __future__ import annotations

import torch

from . import _checks as C
from ._plans import Plans, dispatch_plan
from ._registry import define


@C.once_per_signature
def check_merge_args(outs, lses):
    C.check_tensor(outs, "outs", 4, C.REFERENCE_DTYPES)
    C.check_tensor(lses, "lses", 3, C.lse_dtype(outs.dtype))
    C.check(lses.shape == outs.shape[:3], "lses", f"shape {tuple(lses.shape)} must equal outs.shape[:3] "
            f"{tuple(outs.shape[:3])} ([N, B, H])")
    C.check(outs.shape[0] > 0, "outs", "needs at least one partial state (N >= 1)")
    C.check_same_device(dict(outs=outs, lses=lses))


def _merge_weights(lses: torch.Tensor):
    """(ok [N, B, H]: finite parts, w [N, B, H]: e^(lse_i - lse) (0 for the others), lse [B, H])."""
    ok = torch.isfinite(lses)
    m = torch.where(ok, lses, float("-inf")).amax(dim=0)
    m = torch.where(torch.isfinite(m), m, 0.0)  # all parts empty -> M = 0
    w = torch.where(ok, torch.exp(lses - m), 0.0)  # [N, B, H]
    total = w.sum(dim=0)
    lse = torch.where(total > 0, m + torch.log(total), float("-inf"))
    return ok, w / torch.where(total > 0, total, 1.0), lse


def _finite_parts(outs: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    # where() rather than w * out: a foreign kernel's empty row may hold NaN, and 0 * NaN = NaN
    return torch.where(ok[..., None], outs.to(C.lse_dtype(outs.dtype)), 0.0)


def merge_states_reference(outs: torch.Tensor, lses: torch.Tensor):
    """Plain-torch merge in lses' dtype (float32, or float64). A part whose lse is not finite contributes exactly 0."""
    ok, w, lse = _merge_weights(lses)
    out = (_finite_parts(outs, ok) * w[..., None]).sum(dim=0)
    return out.to(outs.dtype).contiguous(), lse.contiguous()


def merge_states_backward(outs, lses, grad_out, grad_lse):
    """Gradients of the merge w.r.t. (outs, lses). With w_i = e^(lse_i - lse) and out = sum_i w_i out_i:
    d outs_i = w_i dout; d lses_i = w_i (dout . out_i - dout . out + dlse). Parts that weigh 0 (non-finite lse)
    get exactly 0, whatever they hold."""
    ok, w, _ = _merge_weights(lses)
    parts = _finite_parts(outs, ok)
    out = (parts * w[..., None]).sum(dim=0)
    g_out = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype)
    g_lse = torch.zeros_like(out[..., 0]) if grad_lse is None else grad_lse.to(out.dtype)
    d_outs = w[..., None] * g_out
    d_lses = w * ((parts * g_out).sum(-1) - (out * g_out).sum(-1) + g_lse)
    return d_outs.to(outs.dtype), torch.where(ok, d_lses, 0.0).to(lses.dtype)


@define(
    "mla::merge_states",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor outs, Tensor lses) -> (Tensor, Tensor)",
)
def merge_states(outs, lses):
    """LSE-weighted combine of N partial attention states.

    Shapes: outs [N, B, H, R] (any float dtype), lses float32 [N, B, H] (natural log; float64 with float64 outs).
    M = max lse (0 if all -inf); lse = M + log sum_i e^(lse_i - M); out = sum_i e^(lse_i - lse) out_i.
    A part with -inf, +inf or NaN lse contributes exactly 0; all parts empty -> (0, -inf).
    Returns out [B, H, R] (outs' dtype), lse [B, H] (lses' dtype). Differentiable in outs and lses.
    """
    check_merge_args(outs, lses)
    return merge_states_reference(outs, lses)


@merge_states.register_fake
def _(outs, lses):
    check_merge_args(outs, lses)
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


@merge_states.register_kernel("cuda")
def _(outs, lses):
    if outs.dtype == torch.float64:  # no kernel computes in float64: the reference
        check_merge_args(outs, lses)
        return merge_states_reference(outs, lses)
    return _PLANS.run((outs, lses), (), check_merge_args, _make_plan, (outs, lses))


_PLANS = Plans()  # one plan per call signature (ops/_plans.py)
_make_plan = dispatch_plan("merge_states_plan")


def _merge_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _merge_backward(ctx, grad_out, grad_lse):
    outs, lses = ctx.saved_tensors
    return merge_states_backward(outs, lses, grad_out, grad_lse)


merge_states.register_autograd(_merge_backward, setup_context=_merge_setup_context)
