"""`mla::merge_states`: combine partial attention states (out_i, lse_i) by log-sum-exp.

This is the ONE home of the merge math: DCP ranks, split-KV stages and any foreign kernel's partials all
combine through it, in natural-log LSE.
"""

from __future__ import annotations

import torch

from . import _checks as C


def check_merge_args(outs, lses):
    C.check_tensor(outs, "outs", 4, C.FLOAT_DTYPES)
    C.check_tensor(lses, "lses", 3, torch.float32)
    C.check(lses.shape == outs.shape[:3], "lses", f"shape {tuple(lses.shape)} must equal outs.shape[:3] "
            f"{tuple(outs.shape[:3])} ([N, B, H])")
    C.check(outs.shape[0] > 0, "outs", "needs at least one partial state (N >= 1)")
    C.check_same_device(dict(outs=outs, lses=lses))


def merge_states_reference(outs: torch.Tensor, lses: torch.Tensor):
    """Plain-torch merge, fp32 math. A part whose lse is not finite contributes exactly 0."""
    ok = torch.isfinite(lses)
    m = torch.where(ok, lses, float("-inf")).amax(dim=0)
    m = torch.where(torch.isfinite(m), m, 0.0)  # all parts empty -> M = 0
    w = torch.where(ok, torch.exp(lses - m), 0.0)  # [N, B, H]
    total = w.sum(dim=0)
    lse = torch.where(total > 0, m + torch.log(total), float("-inf"))
    w = w / torch.where(total > 0, total, 1.0)
    # where() rather than w * out: a foreign kernel's empty row may hold NaN, and 0 * NaN = NaN
    parts = torch.where(ok[..., None], outs.float() * w[..., None], 0.0)
    return parts.sum(dim=0).to(outs.dtype).contiguous(), lse.contiguous()


@torch.library.custom_op(
    "mla::merge_states",
    mutates_args=(),
    device_types="cpu",
    schema="(Tensor outs, Tensor lses) -> (Tensor, Tensor)",
)
def merge_states(outs, lses):
    """LSE-weighted combine of N partial attention states.

    Shapes: outs [N, B, H, R] (any float dtype), lses float32 [N, B, H] (natural log).
    M = max lse (0 if all -inf); lse = M + log sum_i e^(lse_i - M); out = sum_i e^(lse_i - lse) out_i.
    A part with -inf, +inf or NaN lse contributes exactly 0; all parts empty -> (0, -inf).
    Returns out [B, H, R] (outs' dtype), lse float32 [B, H].
    """
    check_merge_args(outs, lses)
    return merge_states_reference(outs, lses)


@merge_states.register_fake
def _(outs, lses):
    check_merge_args(outs, lses)
    return outs.new_empty(outs.shape[1:]), lses.new_empty(lses.shape[1:])


@merge_states.register_kernel("cuda")
def _(outs, lses):
    check_merge_args(outs, lses)
    from ..kernels import dispatch

    return dispatch.merge_states(outs, lses)
