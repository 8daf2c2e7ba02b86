"""Rope-less MLA (P = 0: glm5_next, mistral_large4's no_rope_layers) through the kernels (kernels/dispatch.py).

The kernels are written and tuned for P > 0 (a rope tile of width block(P), TMA boxes of P columns), so a P = 0 call
is handed to them as P = 1 with a zero rope column: q_pe and kpe become stride-0 views of ONE zero element. Exactly
equivalent (every score gains q_pe . kpe = 0 * 0 = +0, and kpe is never NaN), and cheap: one 1-element fill, no
cache-sized copy, no host sync (CUDA graphs keep working), and the Triton kernels' speed instead of the plain-torch
reference, which would gather the whole block-table capacity in fp32. The cost: P = 1 is no TMA box width, so every
P = 0 call takes the pointer kernel (not TMA / Gluon: slower at >= 64 heads), and FlashInfer (built for P = 64) is
skipped.
"""

from __future__ import annotations

import torch


def rope_less(q_pe: torch.Tensor) -> bool:
    return q_pe.shape[-1] == 0


def zero_rope_column(zero: torch.Tensor, *lead: int) -> torch.Tensor:
    """[*lead, 1] view of the one-element tensor `zero`: strides 0 but a unit last stride (the kernels require
    it), so any number of rows costs one element."""
    return zero.as_strided((*lead, 1), (0,) * len(lead) + (1,))


def with_zero_rope(q_nope, ckv_cache):
    """(q_pe [B, H, 1], kpe_cache [NP, PS, 1]) of zeros, both views of one fresh zero element (all strides 0: the
    kernels read it by pointer, so q [B, S, H, R] handed to an `outer` plan gives a [B, S, 1] view of it, as good)."""
    zero = q_nope.new_zeros(1)
    return zero_rope_column(zero, *q_nope.shape[:2]), zero_rope_column(zero, *ckv_cache.shape[:2])


def zero_rope_run(plan, zero: bool):
    """A plan as it is, or (rope-less calls) one that hands it a fresh zero rope column per call in place of the
    call's empty q_pe / kpe_cache."""
    if not zero:
        return plan

    def with_zero_column(qn, qp, ckv, kpe, table, lens, scale):
        qp, kpe = with_zero_rope(qn, ckv)
        return plan(qn, qp, ckv, kpe, table, lens, scale)

    return with_zero_column
