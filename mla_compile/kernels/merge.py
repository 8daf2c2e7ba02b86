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
    merge_row_block(O, L, Out, Lse, tl.program_id(0), tl.program_id(1), N, H, R, s_on, s_ob, s_oh, s_ln, s_lb, s_lh,
                    s_outb, s_outh, s_lseb, s_lseh, BLOCK_N, BLOCK_R, ONE_PASS)


@triton.jit
def merge_row_block(O, L, Out, Lse, bh, rb, N, H, R,
                    s_on, s_ob, s_oh, s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb, s_lseh,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ONE_PASS: tl.constexpr):
    """Row bh (= b * H + h) of the merge, columns [rb * BLOCK_R, (rb + 1) * BLOCK_R): out from the N parts O [N, B,
    H, R] weighted by their lses L [N, B, H]; the lse itself from column block 0."""
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


# ---- a split launch that merges itself --------------------------------------------------------------------------
# Where an eager split-KV call's host time is the bottleneck (default-mode compile, eager decode: the GPU work of a
# short call hides behind ~6 us of host per launch), stage 1 and this merge run as ONE launch: its programs take work
# in ticket order (an atomic counter), the first tickets the stage-1 programs, the rest the merge's items (row,
# column block: `_merge_kernel`'s grid). A merge program waits until its group's (request, head block's) splits have
# all arrived, then merges as `_merge_kernel` would (bitwise: the same code). Tickets, not program ids, make the wait
# safe: a merge ticket is handed out only after every stage-1 ticket, i.e. to a program that starts after every
# stage-1 program it may wait for is already running, so no co-residency is assumed (the order in which the GPU
# schedules programs is not). Counters (int32, zero before and after the launch; kernels/scratch.py hands them out
# where launches are ordered): C[0] tickets, C[1] merge items done, C[2 + group] the group's arrived splits, then its
# merge items done; the last merge item of a group puts its slot back to 0, the last of all C[0] and C[1].
# The helpers are scalar code, so the Gluon stage-1 kernels call them too (`_gluon.merge_row_block` is this file's
# `merge_row_block` in Gluon).


@triton.jit
def take_ticket(C, n_split_programs):
    """(this program's ticket, whether it is a stage-1 program: ticket < n_split_programs)."""
    ticket = tl.atomic_add(C, 1, sem="relaxed", scope="gpu")
    return ticket, ticket < n_split_programs


@triton.jit
def arrive(C, group):
    """A stage-1 program's partial is written: every thread's stores ordered (CTA barrier) before one release add
    at GPU scope (CUTLASS's semaphore), which the group's merge programs acquire."""
    tl.debug_barrier()
    tl.atomic_add(C + 2 + group, 1, sem="release", scope="gpu")


@triton.jit
def _merge_group(item, B, H, GROUP_H):
    """(row bh = b * H + h, column block, group b * ceil(H / GROUP_H) + h // GROUP_H) of merge item `item`."""
    rows = B * H
    bh = item % rows
    return bh, item // rows, (bh // H) * tl.cdiv(H, GROUP_H) + (bh % H) // GROUP_H


@triton.jit
def wait_for_group(C, item, B, H, N, GROUP_H):
    """(row, column block) of merge item `item` once the N splits of its group have arrived."""
    bh, rb, group = _merge_group(item, B, H, GROUP_H)
    seen = tl.atomic_add(C + 2 + group, 0, sem="acquire", scope="gpu")
    while seen < N:
        seen = tl.atomic_add(C + 2 + group, 0, sem="acquire", scope="gpu")
    return bh, rb


@triton.jit
def leave_group(C, item, n_items, B, H, N, GROUP_H):
    """Merge item `item` (of n_items) is done: the last of its group zeroes the group's slot, the last of all C[0]
    and C[1]."""
    bh, rb, group = _merge_group(item, B, H, GROUP_H)
    hb = (bh % H) // GROUP_H
    in_group = tl.minimum(GROUP_H, H - hb * GROUP_H) * (n_items // (B * H))
    left = tl.atomic_add(C + 2 + group, 1, sem="acq_rel", scope="gpu")
    if left == N + in_group - 1:
        tl.store(C + 2 + group, 0)
    done = tl.atomic_add(C + 1, 1, sem="acq_rel", scope="gpu")
    if done == n_items - 1:
        tl.store(C, 0)
        tl.store(C + 1, 0)


@triton.jit
def merge_when_arrived(C, item, n_items, B, O, L, Out, Lse, N, H, R,
                       s_on, s_ob, s_oh, s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb, s_lseh, GROUP_H: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, ONE_PASS: tl.constexpr):
    """Merge item `item` of n_items once the N splits of its group (request b, rows of head block h // GROUP_H)
    have arrived (a Triton stage-1 kernel's merge programs)."""
    bh, rb = wait_for_group(C, item, B, H, N, GROUP_H)
    merge_row_block(O, L, Out, Lse, bh, rb, N, H, R, s_on, s_ob, s_oh, s_ln, s_lb, s_lh, s_outb, s_outh, s_lseb,
                    s_lseh, BLOCK_N, BLOCK_R, ONE_PASS)
    leave_group(C, item, n_items, B, H, N, GROUP_H)


def merge_work(N: int, out, lse, groups: int, device) -> tuple[dict, tuple, int, int] | None:
    """What a self-merging stage-1 launch of N splits over `groups` (request, head block) groups takes beside its
    stage-1 arguments, writing out [B, H, R] / lse [B, H] (meta tensors will do: their strides are read): (the
    constexprs MERGE_N, MERGE_R, MERGE_ONE_PASS: `merge_when_arrived`'s BLOCK_N, BLOCK_R, ONE_PASS; the numbers after
    C, Out, Lse: out's and lse's strides, B, the merge items; the counter slots; the grid), or None where that launch
    would not fit one wave.

    One wave: on a GPU the stage-1 programs and every merge item must fit one program per SM (the swap-AB kernel's
    shared memory allows no more), column blocks widened from `_merge_kernel`'s tiling until they do. A merge program
    holds the stage-1 kernel's shared memory, so one that must wait for a free SM costs a second wave of big
    programs: H200 2026-12-07 (benchmarks/RESULTS.md), queued GPU us per call H 16 B 4 4K 10.0 with two launches vs
    60.0 in one launch of 132 stage-1 + 256 merge programs, B 1 1K 6.3 vs 10.3 at 16 + 128. Under the interpreter
    (CPU tensors) `_merge_kernel`'s tiling as it is."""
    device = torch.device(device)
    B, H, R = out.shape
    rows, split_programs, sms = B * H, groups * N, sm_count(device)
    block_n, block_r, _ = _tiles(N, rows, R, sms)
    if device.type == "cuda":
        while split_programs + rows * cdiv(R, block_r) > sms and block_r < next_power_of_2(max(R, 1)):
            block_r *= 2
        if split_programs + rows * cdiv(R, block_r) > sms:
            return None
        block_n = min(next_power_of_2(N), _parts_per_tile(block_r))
    items = rows * max(1, cdiv(R, block_r))
    return (dict(MERGE_N=block_n, MERGE_R=block_r, MERGE_ONE_PASS=N <= block_n),
            (out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), B, items), 2 + groups, split_programs + items)


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
