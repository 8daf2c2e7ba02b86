"""Few-token linear layers: y_i = x @ W_i^T for one or two weights that share x (decode: M <= 16 rows).

At decode batch sizes every projection of an MLA layer is a weight read with a few rows of x, and a small
cuBLAS GEMM costs ~5.5 us on the H200 however narrow the weight; q_a_proj and kv_a_proj (same x) are two of
them. Here two weights sharing x are one launch over the union of their row blocks - the fused `qkv_a`
projection of vLLM / SGLang without concatenating weights. Each program owns BLOCK_N weight rows; tokens are
the MMA's N side (padded to 16). When the row blocks are too few to keep the SMs streaming (long K, few rows),
K is split across programs too: each split writes fp32 partials, summed and cast by the last program of each row
block to finish (arrival counters, where kernels/scratch.py can hand them out) or else by one more launch.
`per_head_linear` runs the same row-block product with one weight per head (MLA's absorbed W_UK / W_UV).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import torch
import triton
import triton.language as tl

from .few_token import FEW_TOKEN_ROWS, K_ALIGN, few_token_rows, split_width
from ._util import cdiv, dot_mode, mma, next_power_of_2, pdl_enter, pdl_launch, sm_count
from ._launch import bind
from .scratch import Scratch, empty_maker

MAX_M = FEW_TOKEN_ROWS  # the MMA's N side (rows of x padded to it)


@dataclasses.dataclass(frozen=True)
class LinearConfig:
    block_n: int = 32
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # > 1: programs also split K, fp32 partials, then one summing launch


@triton.jit
def _rows_times_x(X, W, Y, M, N, k_lo, k_hi, n0, s_xm, s_xk, s_wn, s_wk, s_ym, s_yn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Y[:, n0:n0+BLOCK_N] = X[:, k_lo:k_hi] @ W[n0:n0+BLOCK_N, k_lo:k_hi]^T, fp32 accumulation as W-rows x
    tokens, stored in Y's dtype."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = k_lo + tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_ptrs = W + offs_n[:, None].to(tl.int64) * s_wn + offs_k[None, :] * s_wk
    x_ptrs = X + offs_m[None, :] * s_xm + offs_k[:, None] * s_xk
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # masks constant along K: the weight loads stay 16-byte vectors
            w = tl.load(w_ptrs, mask=mask_n[:, None], other=0.0)
            x = tl.load(x_ptrs, mask=mask_m[None, :], other=0.0)
        else:
            k_ok = (k0 + tl.arange(0, BLOCK_K)) < k_hi
            w = tl.load(w_ptrs, mask=mask_n[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_ptrs, mask=mask_m[None, :] & k_ok[:, None], other=0.0)
        acc = mma(w, x, acc, DOT_PREC, DOT_UPCAST)
        w_ptrs += BLOCK_K * s_wk
        x_ptrs += BLOCK_K * s_xk
    tl.store(Y + offs_m[None, :] * s_ym + offs_n[:, None] * s_yn, acc.to(Y.dtype.element_ty),
             mask=mask_m[None, :] & mask_n[:, None])


@triton.jit
def _pair_rows_times_x(X, W0, W1, Y0, Y1, M, N0, N1, K, k_split, s_xm, s_xk, s_w0n, s_w0k, s_w1n, s_w1k,
                       s_y0m, s_y0n, s_y1m, s_y1n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Program (pid, split)'s product over K range [split * k_split, +k_split): its block of W0's rows into Y0 for
    pid < cdiv(N0, BLOCK_N), else its block of W1's rows into Y1."""
    pid = tl.program_id(0)
    k_lo = tl.program_id(1) * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    nb0 = tl.cdiv(N0, BLOCK_N)
    if pid < nb0:
        _rows_times_x(X, W0, Y0, M, N0, k_lo, k_hi, pid * BLOCK_N, s_xm, s_xk, s_w0n, s_w0k, s_y0m, s_y0n,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PREC, DOT_UPCAST)
    else:
        _rows_times_x(X, W1, Y1, M, N1, k_lo, k_hi, (pid - nb0) * BLOCK_N, s_xm, s_xk, s_w1n, s_w1k, s_y1m, s_y1n,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PREC, DOT_UPCAST)


@triton.jit
def _linear_kernel(X, W0, W1, Y0, Y1, M, N0, N1, K, k_split,
                   s_xm, s_xk, s_w0n, s_w0k, s_w1n, s_w1k, s_ys, s_y0m, s_y0n, s_y1m, s_y1n, y0_at, y1_at,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                   DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """Programs [0, cdiv(N0, BLOCK_N)) own rows of W0, the rest rows of W1 (N1 = 0: one weight); axis 1 splits
    K in k_split-wide ranges, each writing its own partial at Y + split * s_ys (s_ys = 0: no split). Y0 / Y1
    start y0_at / y1_at elements into their buffers (one buffer's column ranges: no view per call)."""
    pdl_enter(PDL)
    split = tl.program_id(1)
    _pair_rows_times_x(X, W0, W1, Y0 + y0_at + split * s_ys, Y1 + y1_at + split * s_ys, M, N0, N1, K, k_split,
                       s_xm, s_xk, s_w0n, s_w0k, s_w1n, s_w1k, s_y0m, s_y0n, s_y1m, s_y1n,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PREC, DOT_UPCAST)


@triton.jit
def _per_head_kernel(X, W, Y, M, N, K, s_xm, s_xh, s_xk, s_wh, s_wn, s_wk, s_ym, s_yh, s_yn,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                     DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, PDL: tl.constexpr = False):
    """Program (head h, row block): Y[:, h, rows] = X[:, h, :] @ W[h, rows, :]^T (`mla::per_head_linear`)."""
    pdl_enter(PDL)
    h = tl.program_id(0).to(tl.int64)
    _rows_times_x(X + h * s_xh, W + h * s_wh, Y + h * s_yh, M, N, 0, K, tl.program_id(1) * BLOCK_N, s_xm, s_xk,
                  s_wn, s_wk, s_ym, s_yn, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PREC, DOT_UPCAST)


@triton.jit
def _split_sum_tile(P, Y, M, N, n0, S, s_ps, s_pm, s_ym, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Y[:, n0:n0+BLOCK_N] = sum over the S splits of P[s, :, n0:n0+BLOCK_N] (fp32 partials, unit column stride),
    cast once. Loads through L2 only: other programs wrote these partials during this launch."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    ok = (offs_m < M)[None, :] & (offs_n < N)[:, None]
    ptrs = P + offs_m[None, :] * s_pm + offs_n[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for s in range(0, S):
        acc += tl.load(ptrs + s * s_ps, mask=ok, other=0.0, cache_modifier=".cg")
    tl.store(Y + offs_m[None, :] * s_ym + offs_n[:, None], acc.to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _linear_split_sum_kernel(X, W0, W1, P, C, Y0, Y1, M, N0, N1, K, k_split, S,
                             s_xm, s_xk, s_w0n, s_w0k, s_w1n, s_w1k, s_ps, s_pm, s_y0m, s_y1m,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             EVEN_K: tl.constexpr, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
                             PDL: tl.constexpr = False):
    """`_linear_kernel` over K splits and `_sum_splits_kernel` in one launch. Program (row block, split) writes its
    fp32 partial into P [S, M, N0 + N1] (W0's rows, then W1's), then counts itself in C[row block]; the last of
    the block's S programs to arrive sums the block's partials into Y0 / Y1 and puts the counter back to 0 (every
    counter is 0 before and after a launch: kernels/scratch.py hands them out only where launches are ordered).
    The arrival is CUTLASS's semaphore: a CTA barrier orders every thread's partial before one thread's
    acquire-release add at GPU scope, whose result the whole CTA then sees."""
    pdl_enter(PDL)
    pid = tl.program_id(0)
    split = tl.program_id(1)
    nb0 = tl.cdiv(N0, BLOCK_N)
    _pair_rows_times_x(X, W0, W1, P + split * s_ps, P + N0 + split * s_ps, M, N0, N1, K, k_split,
                       s_xm, s_xk, s_w0n, s_w0k, s_w1n, s_w1k, s_pm, 1, s_pm, 1,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, DOT_PREC, DOT_UPCAST)
    tl.debug_barrier()
    arrived = tl.atomic_add(C + pid, 1, sem="acq_rel", scope="gpu")
    if arrived == S - 1:
        if pid < nb0:
            _split_sum_tile(P, Y0, M, N0, pid * BLOCK_N, S, s_ps, s_pm, s_y0m, BLOCK_M, BLOCK_N)
        else:
            _split_sum_tile(P + N0, Y1, M, N1, (pid - nb0) * BLOCK_N, S, s_ps, s_pm, s_y1m, BLOCK_M, BLOCK_N)
        tl.store(C + pid, 0)


@triton.jit
def _sum_splits_kernel(P, Y0, Y1, S, N0, N1, s_ps, s_pm, s_y0m, s_y1m, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """Y0 | Y1 [m, :] = sum over splits of P[:, m, :] (P's columns: W0's rows, then W1's), cast once."""
    pdl_enter(PDL)
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N0 + N1
    acc = tl.zeros([BLOCK], tl.float32)
    for s in range(0, S):
        acc += tl.load(P + s * s_ps + m * s_pm + cols, mask=ok, other=0.0)
    tl.store(Y0 + m * s_y0m + cols, acc.to(Y0.dtype.element_ty), mask=cols < N0)
    tl.store(Y1 + m * s_y1m + (cols - N0), acc.to(Y1.dtype.element_ty), mask=ok & (cols >= N0))


def default_linear_config(M: int, K: int, N: int) -> LinearConfig:
    """From the H200 sweeps (benchmarks/linear_sweep.py; rounds 1-2 JSON at commit 20a0395; M=8):
    32-row blocks, 128-wide K steps; K split so that (row blocks x splits) is near 256 programs (~2 per SM):
    DeepSeek-V3's q_a + kv_a (N 2112, K 7168) 11.5 us with 4 splits vs 18.0 unsplit and 18.9 as two cuBLAS
    GEMMs; down (K 8192) 12.2 vs cuBLAS 13.8. Unsplit and K <= 4096: 3 stages (gate + up at K 2048: 18.4 vs
    22.6 us with 4), else 4."""
    blocks = cdiv(N, 32)
    split = 1 << max(0, min(3, round(math.log2(256 / blocks))))
    while split > 1 and K // split < 512:  # keep >= 4 K steps per split
        split //= 2
    stages = 3 if split == 1 and K <= 4096 else 4
    return LinearConfig(block_n=32, block_k=128, num_warps=4, num_stages=stages, split_k=split)


def _pair_launches(x, weights, ys, k_split: int, splits: int, cfg: LinearConfig, s_ys: int, at=None) -> list:
    """`_linear_kernel` bound once per pair of weights: [(bound, first, second, numbers)]; the pair's launch is
    `bound(x, weights[first], weights[second], ys[first], ys[second], *numbers)`, ys[i] receiving x @ weights[i]^T
    ([M, N_i], or fp32 partials [splits, M, N_i] with split stride s_ys; s_ys = 0: no split) from element at[i] of
    the tensor passed (default 0: ys[i] itself; one buffer for every weight, its column ranges as offsets)."""
    M, K = x.shape
    at = at or (0,) * len(weights)
    launches = []
    for i in range(0, len(weights), 2):
        j = min(i + 1, len(weights) - 1)  # a lone weight: W1 is W0 again with no rows of its own (n1 = 0)
        w0, w1, y0, y1 = weights[i], weights[j], ys[i], ys[j]
        n0, n1 = w0.shape[0], (w1.shape[0] if j > i else 0)
        grid = (cdiv(n0, cfg.block_n) + cdiv(n1, cfg.block_n), splits)
        if grid[0] == 0:
            continue
        bound = bind(_linear_kernel, grid, BLOCK_M=MAX_M, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                     EVEN_K=K % cfg.block_k == 0, **dot_mode(x.dtype), num_warps=cfg.num_warps,
                     num_stages=cfg.num_stages, **pdl_launch(x.device))
        launches.append((bound, i, j, (M, n0, n1, K, k_split, x.stride(0), x.stride(1), w0.stride(0), w0.stride(1),
                                       w1.stride(0), w1.stride(1), s_ys, y0.stride(-2), y0.stride(-1),
                                       y1.stride(-2), y1.stride(-1), at[i], at[j])))
    return launches


def _run_pairs(launches, x, weights, part) -> None:
    """The pair launches of `_partial_launches` into the partials `part`."""
    for bound, i, j, numbers in launches:
        bound(x, weights[i], weights[j], part, part, *numbers)


def _partial_launches(x: torch.Tensor, weights, splits: int, cfg: LinearConfig, align: int):
    """(the pair launches writing fp32 partials [splits, M, sum N_i], the partials' Scratch: `get()` / `fresh()` ->
    (the partials,)) for inputs of this signature (M, N, K > 0). Every launch is handed the whole partials tensor
    for both its outputs; each weight's columns start at its offset (`_pair_launches`' at)."""
    M, K = x.shape
    shape = (splits, M, sum(w.shape[0] for w in weights))
    k_split = split_width(K, splits, align)
    if k_split % cfg.block_k:
        raise ValueError(f"cfg: block_k {cfg.block_k} must divide the split width {k_split}")
    cols = tuple(itertools.accumulate((w.shape[0] for w in weights), initial=0))
    part = torch.empty(shape, dtype=torch.float32, device=torch.device("meta"))
    views = [part[:, :, lo:hi] for lo, hi in zip(cols, cols[1:])]  # their strides (the offsets go as numbers)
    launches = _pair_launches(x, weights, views, k_split, splits, cfg, part.stride(0), at=cols[:-1])
    return launches, Scratch([shape], x.device)


def linear_partials_plan(x: torch.Tensor, weights: list[torch.Tensor], splits: int, cfg: LinearConfig | None = None,
                         align: int = K_ALIGN):
    """`plan(x, *weights)` -> `linear_partials(x, weights, splits)` for inputs of this signature: one allocation,
    the column views of each weight's partials, the bound launches."""
    M, K = x.shape
    N = sum(w.shape[0] for w in weights)
    shape, device = (splits, M, N), x.device
    if M == 0 or N == 0 or K == 0:
        return lambda x, *weights: torch.zeros(shape, dtype=torch.float32, device=device)
    launches, _ = _partial_launches(x, weights, splits, cfg or default_linear_config(M, K, N), align)
    fresh = empty_maker(shape, torch.float32, device)  # the op's output: a tensor of its own each call

    if len(launches) == 1:  # one pair of weights (the MLA projections' case): one frame to the launch
        ((bound, i, j, numbers),) = launches

        def one_pair(x, *weights):
            part = fresh()
            bound(x, weights[i], weights[j], part, part, *numbers)
            return part

        return one_pair

    def plan(x, *weights):
        part = fresh()
        _run_pairs(launches, x, weights, part)
        return part

    return plan


def linear_partials(x: torch.Tensor, weights: list[torch.Tensor], splits: int, cfg: LinearConfig | None = None,
                    align: int = K_ALIGN) -> torch.Tensor:
    """fp32 [splits, M, sum N_i]: partial s = x[:, r_s] @ [W_0 | W_1 | ...][:, r_s]^T over the K range
    r_s = [s * w, min((s + 1) * w, K)), w = `split_width(K, splits, align)` (empty ranges give zeros); their sum
    is x @ W^T. x [M, K] (M <= 16), weights [N_i, K] (any strides)."""
    return linear_partials_plan(x, weights, splits, cfg, align)(x, *weights)


def small_m_plan(x: torch.Tensor, weights: list[torch.Tensor], cfg: LinearConfig | None = None,
                 sum_in_kernel: bool | None = None):
    """`plan(x, *weights, outs=None)` -> `linear_small_m(x, weights, outs=outs)` for inputs of this signature (one or
    two weights). Called with the op's own arguments: `mla::fused_linear` of a flat x and one pair runs it as its
    plan, one frame from the op to the launches. Split K sums the splits' partials in the split launch itself
    where zeroed counters are at hand (None: on the legacy default stream, kernels/scratch.py; True: always, a
    zeroed counter tensor allocated per call), else (False, or elsewhere) in a second launch."""
    M, K = x.shape
    shapes, dtype, device = [(M, w.shape[0]) for w in weights], x.dtype, x.device
    if cfg is None:
        cfg = default_linear_config(M, K, sum(w.shape[0] for w in weights))
    n0, n1 = weights[0].shape[0], (weights[-1].shape[0] if len(weights) == 2 else 0)

    # the outputs, allocated inline in each closure (`empty_maker`: a template's empty_like; no helper frame)
    two, fresh0, fresh1 = len(shapes) == 2, empty_maker(shapes[0], dtype, device), empty_maker(shapes[-1], dtype,
                                                                                             device)
    if M == 0 or n0 + n1 == 0 or K == 0:  # nothing to launch (K == 0: the product is all zeros)
        return lambda x, *weights, outs=None: [o.zero_() for o in (
            outs if outs is not None else [fresh0(), fresh1()] if two else [fresh0()])]
    meta = [torch.empty(s, device=torch.device("meta")) for s in shapes]  # the outputs' (row-major) strides
    splits = cdiv(K, split_width(K, cfg.split_k, cfg.block_k))
    if splits == 1:
        ((bound, _, _, numbers),) = _pair_launches(x, weights, meta, K, 1, cfg, 0)

        def one_pass(x, *weights, outs=None):
            if outs is None:
                outs = [fresh0(), fresh1()] if two else [fresh0()]
            bound(x, weights[0], weights[-1], outs[0], outs[-1], *numbers)
            return outs

        return one_pass
    ((partial, _, _, partial_numbers),), buffers = _partial_launches(x, weights, splits, cfg, cfg.block_k)
    blocks = cdiv(n0, cfg.block_n) + cdiv(n1, cfg.block_n)
    if sum_in_kernel is None:  # where counters are handed out (kernels/scratch.py): the sum in the split launch
        buffers.counters = blocks
    get = buffers.get
    block = 512
    sum_splits = bind(_sum_splits_kernel, (M, cdiv(n0 + n1, block)), BLOCK=block, **pdl_launch(x.device))
    # the partials' split and row strides (contiguous [splits, M, n0 + n1]), the outputs' row strides
    numbers = (splits, n0, n1, M * (n0 + n1), n0 + n1, meta[0].stride(0), meta[-1].stride(0))
    split_sum = bind(_linear_split_sum_kernel, (blocks, splits), BLOCK_M=MAX_M, BLOCK_N=cfg.block_n,
                     BLOCK_K=cfg.block_k, EVEN_K=K % cfg.block_k == 0, **dot_mode(x.dtype), num_warps=cfg.num_warps,
                     num_stages=cfg.num_stages, **pdl_launch(x.device))
    # M N0 N1 K k_split S, x's and the weights' strides, the partials' split / row strides, the outputs' row strides
    split_sum_numbers = (M, n0, n1, K, split_width(K, splits, cfg.block_k), splits, *x.stride(),
                         *weights[0].stride(), *weights[-1].stride(), *numbers[3:])

    if sum_in_kernel:  # always, with counters of its own per call (zeroed: a memset, which graphs can capture)
        counters = functools.partial(torch.zeros, blocks, dtype=torch.int32, device=x.device)

        def split_k_summed(x, *weights, outs=None):
            if outs is None:
                outs = [fresh0(), fresh1()] if two else [fresh0()]
            (part,) = get()
            split_sum(x, weights[0], weights[-1], part, counters(), outs[0], outs[-1], *split_sum_numbers)
            return outs

        return split_k_summed

    def split_k(x, *weights, outs=None):
        if outs is None:
            outs = [fresh0(), fresh1()] if two else [fresh0()]
        (part,) = get()  # this call's intermediate: scratch where it is safe (kernels/scratch.py)
        partial(x, weights[0], weights[-1], part, part, *partial_numbers)
        sum_splits(part, outs[0], outs[-1], *numbers)
        return outs

    if sum_in_kernel is False:
        return split_k

    def split_k_auto(x, *weights, outs=None):
        if outs is None:
            outs = [fresh0(), fresh1()] if two else [fresh0()]
        part, counters = get()  # scratch and zeroed counters where it is safe, else fresh partials and None
        if counters is None:
            partial(x, weights[0], weights[-1], part, part, *partial_numbers)
            sum_splits(part, outs[0], outs[-1], *numbers)
        else:
            split_sum(x, weights[0], weights[-1], part, counters, outs[0], outs[-1], *split_sum_numbers)
        return outs

    return split_k_auto


def linear_small_m(x: torch.Tensor, weights: list[torch.Tensor], cfg: LinearConfig | None = None,
                   outs: list[torch.Tensor] | None = None, sum_in_kernel: bool | None = None) -> list[torch.Tensor]:
    """x [M, K] (M <= 16), weights: one or two [N_i, K] (nn.Linear layout, any strides) -> [x @ W_i^T]
    (`outs`: contiguous buffers to write instead of new ones; `sum_in_kernel`: `small_m_plan`'s)."""
    return small_m_plan(x, weights, cfg, sum_in_kernel)(x, *weights, outs=outs)


def per_head_plan(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None):
    """`plan(x, weight)` -> `per_head_linear(x, weight)` for inputs of this signature."""
    M, H, K = x.shape
    N = weight.shape[1]
    shape, dtype, device = (M, H, N), x.dtype, x.device
    if M * H * N == 0 or K == 0:
        return lambda x, weight: torch.zeros(shape, dtype=dtype, device=device)
    if block_n is None:
        block_n = 32 if H * cdiv(N, 32) >= sm_count(x.device) else 16
    block_k = min(128, max(16, next_power_of_2(K)))
    bound = bind(_per_head_kernel, (H, cdiv(N, block_n)), BLOCK_M=MAX_M, BLOCK_N=block_n, BLOCK_K=block_k,
                 EVEN_K=K % block_k == 0, **dot_mode(x.dtype), num_warps=4, num_stages=3, **pdl_launch(x.device))
    y = torch.empty(shape, device=torch.device("meta"))
    numbers = (M, N, K, x.stride(0), x.stride(1), x.stride(2), weight.stride(0), weight.stride(1), weight.stride(2),
               y.stride(0), y.stride(1), y.stride(2))

    fresh = empty_maker(shape, dtype, device)

    def plan(x, weight):
        y = fresh()
        bound(x, weight, y, *numbers)
        return y

    return plan


def per_head_linear(x: torch.Tensor, weight: torch.Tensor, block_n: int | None = None) -> torch.Tensor:
    """x [M, H, K] (M <= 16, any strides), weight [H, N, K] (any strides) -> y [M, H, N] contiguous,
    y[:, h] = x[:, h] @ weight[h]^T: one launch over (head, row block), the absorbed MLA projections' shape
    (H 16-128 heads of a [128, 512] weight). Row blocks of 32, or 16 when 32 leave most SMs idle."""
    return per_head_plan(x, weight, block_n)(x, weight)


def fused_plan(x, weights):
    """`plan(x, *weights)` -> `mla::fused_linear(x, weights)` for inputs of this signature.
    Up to 16 rows in fp16/bf16: the few-token kernel, one launch per pair of weights (benchmarks/
    linear_sweep.py, H200: q_a + kv_a 6.6 vs 11.7 us as two cuBLAS GEMMs, gate + up 18.4 vs 21.5, a lone
    K=8192 weight 12.2 vs 13.8; a lone weight with a short K is ~5% slower than cuBLAS, which is why the pass
    does not send those here). Otherwise F.linear per weight."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    if not few_token_rows(x2.shape[0], x2.dtype):
        return lambda x, *weights: [torch.nn.functional.linear(x, w) for w in weights]
    if len(lead) == 1 and len(weights) <= 2:  # x [M, K] and one pair (the pass's case): the pair's plan is the op's
        return small_m_plan(x2, weights)
    pairs = [(i, small_m_plan(x2, weights[i:i + 2])) for i in range(0, len(weights), 2)]
    flat = len(lead) == 1  # x [M, K]: the products are the outputs, no views to take

    def plan(x, *weights):
        x2 = x if flat else x.reshape(-1, K)
        outs = []
        for i, pair in pairs:
            outs += pair(x2, *weights[i:i + 2])
        return outs if flat else [y.view(*lead, y.shape[-1]) for y in outs]

    return plan
