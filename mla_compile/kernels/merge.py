"""Fused LSE merge of N partial attention states: `mla::merge_states` and stage 2 of split-KV decode.

One program per (b, h, block of R). When all N parts fit one tile, lses and outs load together; otherwise
pass 1 reads the lses (max over the finite ones) and pass 2 the outs of finite parts. Either way a part with
a non-finite lse weighs exactly 0, even when its out holds NaN (a foreign kernel's empty row, an empty split).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ._util import cdiv, next_power_of_2, pdl_enter, pdl_launch, sm_count
from ._launch import bind
from .scratch import empty_maker


@triton.jit
def _merge_kernel(O, L, Out, Lse, N, H, R,
                  s_on, s_ob, s_oh, s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb, s_lseh,
                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ONE_PASS: tl.constexpr, PDL: tl.constexpr = False):
    pdl_enter(PDL)
    bh = tl.program_id(0)
    rb = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    l_base = L + b * s_lb + h * s_lh
    o_base = O + b * s_ob + h * s_oh

    if ONE_PASS:
        # all N parts in one tile: lses and outs are loaded together (one memory round trip);
        # non-finite parts are zeroed with where(), never multiplied, so their NaN cannot leak
        lse = tl.load(l_base + offs_n * s_ln, mask=offs_n < N, other=float("-inf"))
        o = tl.load(o_base + offs_n[:, None].to(tl.int64) * s_on + offs_r[None, :],
                    mask=(offs_n < N)[:, None] & mask_r[None, :], other=0.0)
        ok = tl.abs(lse) < float("inf")  # false for +-inf and NaN
        m = tl.max(tl.where(ok, lse, float("-inf")), 0)
        m = tl.where(m == float("-inf"), 0.0, m)  # all parts empty -> M = 0
        w = tl.where(ok, tl.exp(lse - m), 0.0)
        acc = tl.sum(tl.where(ok[:, None], w[:, None] * o.to(tl.float32), 0.0), 0)
        total = tl.sum(w, 0)
    else:
        m_vec = tl.full([BLOCK_N], float("-inf"), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            n = n0 + offs_n
            lse = tl.load(l_base + n * s_ln, mask=n < N, other=float("-inf"))
            m_vec = tl.maximum(m_vec, tl.where(tl.abs(lse) < float("inf"), lse, float("-inf")))
        m = tl.max(m_vec, 0)
        m = tl.where(m == float("-inf"), 0.0, m)
        tot_vec = tl.zeros([BLOCK_N], tl.float32)
        acc = tl.zeros([BLOCK_R], tl.float32)
        for n0 in range(0, N, BLOCK_N):
            n = n0 + offs_n
            lse = tl.load(l_base + n * s_ln, mask=n < N, other=float("-inf"))
            ok = tl.abs(lse) < float("inf")
            w = tl.where(ok, tl.exp(lse - m), 0.0)
            # masked by ok: a non-finite part's out is not even read
            o = tl.load(o_base + n[:, None].to(tl.int64) * s_on + offs_r[None, :],
                        mask=ok[:, None] & mask_r[None, :], other=0.0)
            acc += tl.sum(w[:, None] * o.to(tl.float32), 0)
            tot_vec += w
        total = tl.sum(tot_vec, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * s_outb + h * s_outh + offs_r, out, mask=mask_r)
    if rb == 0:
        tl.store(Lse + b * s_lseb + h * s_lseh, tl.where(total > 0, m + tl.log(total), float("-inf")))


_TILE = 8192  # elements of one [parts, R] tile per program (keeps it in registers)


@functools.lru_cache(maxsize=1024)
def _tiles(N: int, rows: int, R: int, sms: int) -> tuple[int, int, tuple[int, int]]:
    """(BLOCK_N, BLOCK_R, grid) for N parts of `rows` rows of width R (cached: every split-KV decode asks)."""
    block_r = min(next_power_of_2(max(R, 1)), 512)
    while block_r > 64 and rows * cdiv(R, block_r) < 2 * sms:
        block_r //= 2  # few rows (split-KV stage 2 at batch 1): more, narrower programs
    block_n = min(next_power_of_2(N), _parts_per_tile(block_r))
    return block_n, block_r, (rows, max(1, cdiv(R, block_r)))  # R == 0 still needs the lse


def _parts_per_tile(block_r: int) -> int:
    return max(_TILE // block_r, 1)


def one_pass_parts(rows: int, R: int, sms: int) -> int:
    """The most parts `_merge_kernel` merges in one pass over `rows` rows of width R (more take a second pass, which
    a split count should avoid: kernels/decode.py `num_splits`)."""
    return _parts_per_tile(_tiles(1, rows, R, sms)[1])


def merge_bound(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                device: torch.device | None = None):
    """(bound, numbers): `bound(outs, lses, out, lse, *numbers)` merges any tensors of these shapes and strides
    (kernels/decode.py's plans launch it so, one frame from their own); None for bound where there is nothing to
    merge (B * H == 0). `device`: where the launches run (default outs'), for a plan that passes meta tensors for
    the strides."""
    N, B, H, R = outs.shape
    if B * H == 0:
        return None, ()
    assert outs.stride(-1) == 1 and out.stride(-1) == 1
    device = device or outs.device
    block_n, block_r, grid = _tiles(N, B * H, R, sm_count(device))
    bound = bind(_merge_kernel, grid, BLOCK_N=block_n, BLOCK_R=block_r, ONE_PASS=N <= block_n, num_warps=4,
                 **pdl_launch(device))
    numbers = (N, H, R, outs.stride(0), outs.stride(1), outs.stride(2), lses.stride(0), lses.stride(1),
               lses.stride(2), out.stride(0), out.stride(1), lse.stride(0), lse.stride(1))
    return bound, numbers


def merge_launch(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                 device: torch.device | None = None):
    """`merge_bound` as one call: `launch(outs, lses, out, lse)` (nothing to merge: does nothing)."""
    bound, numbers = merge_bound(outs, lses, out, lse, device)
    if bound is None:
        return lambda *tensors: None
    return lambda outs, lses, out, lse: bound(outs, lses, out, lse, *numbers)


def merge_into(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """outs [N, B, H, R] (last dim contiguous), lses [N, B, H] -> out [B, H, R] (any float dtype), lse [B, H]."""
    merge_launch(outs, lses, out, lse)(outs, lses, out, lse)


def merge_states_plan(outs: torch.Tensor, lses: torch.Tensor):
    """`plan(outs, lses)` merges any inputs of this signature (ops/_plans.py): the output allocations and one bound
    launch per call."""
    copy = outs.stride(-1) != 1
    outs = outs.contiguous() if copy else outs
    out_shape, lse_shape = outs.shape[1:], lses.shape[1:]
    fresh_out, fresh_lse = empty_maker(out_shape, outs.dtype, outs.device), empty_maker(lse_shape, lses.dtype,
                                                                                        lses.device)
    meta = torch.device("meta")
    bound, numbers = merge_bound(outs, lses, torch.empty(out_shape, device=meta), torch.empty(lse_shape, device=meta),
                                 outs.device)

    def plan(outs, lses):
        out, lse = fresh_out(), fresh_lse()
        if bound is not None:
            bound(outs.contiguous() if copy else outs, lses, out, lse, *numbers)
        return out, lse

    return plan


def merge_states(outs: torch.Tensor, lses: torch.Tensor):
    """The `mla::merge_states` CUDA impl: (out [B, H, R] outs.dtype, lse float32 [B, H])."""
    return merge_states_plan(outs, lses)(outs, lses)
