"""`mla::expert_linear` on the GPU: out[s] = weight[expert_ids[s]] @ x[s], each pair's expert read in place.

One program per (pair s, block of BLOCK_O output rows): it loads the pair's expert id, streams that expert's
BLOCK_O weight rows along I in BLOCK_I steps and dots them with x[s] in fp32 (a GEMV: at decode a pair is one
token, so there is no MMA to fill). The weight may have any strides (HF's transposed experts arrive as a
transposed view, contiguous along O instead of I; the tile loads stay coalesced along whichever is contiguous).

A pair reads its expert's weight once, so an expert picked by k pairs is read k times. The pairs are the grid's
fastest axis so that the programs resident together are all pairs' programs for the same few row blocks: pairs
that share an expert then read the same rows at about the same time, mostly from L2. When pairs outnumber
experts (S > E: decode with few experts) a kernel grouped by expert would read each expert once, with its pairs
as an MMA's N side; that needs the pairs ordered by expert on the device (a histogram + offsets or a sort, no
host sync, inside the CUDA graph) and a launch over (expert, row block) with each program looping over its
expert's pair range.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._util import cdiv, pdl_enter, pdl_launch
from ._launch import bind
from .scratch import empty_maker

BLOCK_O = 64
BLOCK_I = 128


@triton.jit
def _expert_linear_kernel(X, W, IDS, Y, N_OUT, N_IN, E, s_xs, s_xi, s_we, s_wo, s_wi, s_ys, s_yo,
                          BLOCK_O: tl.constexpr, BLOCK_I: tl.constexpr, EVEN_I: tl.constexpr,
                          PDL: tl.constexpr = False):
    """Program (s, o-block): Y[s, rows] = W[e, rows, :] @ X[s, :] with e = IDS[s] (negative: + E, as indexing)."""
    pdl_enter(PDL)
    s = tl.program_id(0).to(tl.int64)
    e = tl.load(IDS + s).to(tl.int64)
    e = tl.where(e < 0, e + E, e)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    offs_i = tl.arange(0, BLOCK_I)
    mask_o = offs_o < N_OUT
    w_ptrs = W + e * s_we + offs_o[:, None].to(tl.int64) * s_wo + offs_i[None, :] * s_wi
    x_ptrs = X + s * s_xs + offs_i * s_xi
    # products summed elementwise across the I steps, reduced over I once at the end (not a cross-thread
    # reduction per step)
    acc = tl.zeros([BLOCK_O, BLOCK_I], tl.float32)
    for i0 in range(0, N_IN, BLOCK_I):
        if EVEN_I:  # masks constant along I: the weight loads stay vectors
            w = tl.load(w_ptrs, mask=mask_o[:, None], other=0.0)
            x = tl.load(x_ptrs)
        else:
            i_ok = (i0 + offs_i) < N_IN
            w = tl.load(w_ptrs, mask=mask_o[:, None] & i_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=i_ok, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        w_ptrs += BLOCK_I * s_wi
        x_ptrs += BLOCK_I * s_xi
    tl.store(Y + s * s_ys + offs_o * s_yo, tl.sum(acc, axis=1).to(Y.dtype.element_ty), mask=mask_o)


def expert_linear_plan(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor, block_o: int = BLOCK_O,
                       block_i: int = BLOCK_I):
    """`plan(x, weight, expert_ids)` -> `expert_linear(...)` for inputs of this signature (ops/_plans.py)."""
    S, I = x.shape
    E, O = weight.shape[0], weight.shape[1]
    shape, dtype, device = (S, O), x.dtype, x.device
    if S == 0 or O == 0 or I == 0:
        return lambda x, weight, expert_ids: torch.zeros(shape, dtype=dtype, device=device)
    bound = bind(_expert_linear_kernel, (S, cdiv(O, block_o)), BLOCK_O=block_o, BLOCK_I=block_i,
                 EVEN_I=I % block_i == 0, num_warps=4, num_stages=3, **pdl_launch(x.device))
    numbers = (O, I, E, x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), weight.stride(2), O, 1)

    fresh = empty_maker(shape, dtype, device)

    def plan(x, weight, expert_ids):
        y = fresh()
        bound(x, weight, expert_ids, y, *numbers)
        return y

    return plan


def expert_linear(x: torch.Tensor, weight: torch.Tensor, expert_ids: torch.Tensor,
                  block_o: int = BLOCK_O, block_i: int = BLOCK_I) -> torch.Tensor:
    """x [S, I], weight [E, O, I] (any strides), expert_ids [S] int32 / int64 in [-E, E) -> y [S, O] contiguous
    in x's dtype, y[s] = weight[expert_ids[s]] @ x[s] accumulated in fp32. Ids are not range-checked here (the op
    checks them where data checks are on)."""
    return expert_linear_plan(x, weight, expert_ids, block_o, block_i)(x, weight, expert_ids)
