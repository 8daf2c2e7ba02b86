"""Fused LSE merge of N partial attention states: `mla::merge_states` and stage 2 of split-KV decode.

One program per (b, h, block of R): pass 1 reads only the N lses (max over the finite ones); pass 2 reads
the outs of finite parts. A part with a non-finite lse is masked out of the load itself, so its out is never
read: NaN garbage from a foreign kernel's empty row (or an unwritten split) weighs exactly 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _merge_kernel(O, L, Out, Lse, N, H, R,
                  s_on, s_ob, s_oh, s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb, s_lseh,
                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    bh = tl.program_id(0)
    rb = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < R
    l_base = L + b * s_lb + h * s_lh

    m_vec = tl.full([BLOCK_N], float("-inf"), tl.float32)
    for n0 in range(0, N, BLOCK_N):
        n = n0 + offs_n
        lse = tl.load(l_base + n * s_ln, mask=n < N, other=float("-inf"))
        m_vec = tl.maximum(m_vec, tl.where(tl.abs(lse) < float("inf"), lse, float("-inf")))
    m = tl.max(m_vec, 0)
    m = tl.where(m == float("-inf"), 0.0, m)  # all parts empty -> M = 0

    tot_vec = tl.zeros([BLOCK_N], tl.float32)
    acc = tl.zeros([BLOCK_R], tl.float32)
    o_base = O + b * s_ob + h * s_oh
    for n0 in range(0, N, BLOCK_N):
        n = n0 + offs_n
        lse = tl.load(l_base + n * s_ln, mask=n < N, other=float("-inf"))
        ok = tl.abs(lse) < float("inf")  # false for +-inf and NaN
        w = tl.where(ok, tl.exp(lse - m), 0.0)
        o = tl.load(o_base + n[:, None].to(tl.int64) * s_on + offs_r[None, :],
                    mask=ok[:, None] & mask_r[None, :], other=0.0)
        acc += tl.sum(w[:, None] * o.to(tl.float32), 0)
        tot_vec += w
    total = tl.sum(tot_vec, 0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * s_outb + h * s_outh + offs_r, out, mask=mask_r)
    if rb == 0:
        tl.store(Lse + b * s_lseb + h * s_lseh, tl.where(total > 0, m + tl.log(total), float("-inf")))


def merge_into(outs: torch.Tensor, lses: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """outs [N, B, H, R] (last dim contiguous), lses [N, B, H] -> out [B, H, R] (any float dtype), lse [B, H]."""
    N, B, H, R = outs.shape
    if B * H == 0:
        return
    assert outs.stride(-1) == 1 and out.stride(-1) == 1
    block_r = min(triton.next_power_of_2(max(R, 1)), 128)
    block_n = min(triton.next_power_of_2(N), 16)
    grid = (B * H, max(1, triton.cdiv(R, block_r)))  # R == 0 still needs the lse
    _merge_kernel[grid](outs, lses, out, lse, N, H, R,
                        outs.stride(0), outs.stride(1), outs.stride(2),
                        lses.stride(0), lses.stride(1), lses.stride(2),
                        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
                        BLOCK_N=block_n, BLOCK_R=block_r, num_warps=4)


def merge_states(outs: torch.Tensor, lses: torch.Tensor):
    """The `mla::merge_states` CUDA impl: (out [B, H, R] outs.dtype, lse float32 [B, H])."""
    outs = outs if outs.stride(-1) == 1 else outs.contiguous()
    out = outs.new_empty(outs.shape[1:])
    lse = lses.new_empty(lses.shape[1:])
    merge_into(outs, lses, out, lse)
    return out, lse
