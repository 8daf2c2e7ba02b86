"""The Triton stage-1 kernels of decode_stage1.py bound for a call: their compile-time arguments, grids and the numbers
they take (kernels/decode.py's `AttendPlan` keeps them per signature), and one-call launches for the benchmarks."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ._launch import bind, templated_at, without_bases
from ._util import block, cdiv, dot_mode, pdl_launch, query_limit_args, slot_stride
from . import decode_fp8 as _fp8
from . import decode_wgmma as _wgmma
from .decode_stage1 import _stage1_kernel, _stage1_merged_kernel, _stage1_tma_kernel
from .merge import merge_work
from ..fp8 import GROUP as FP8_GROUP

if TYPE_CHECKING:
    from .decode import DecodeConfig

_LOG2E = 1.4426950408889634


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def tma_constexprs(cfg: DecodeConfig, R: int, P: int, dtype: torch.dtype) -> dict:
    """The compile-time arguments of `_stage1_tma_kernel` (shared with tests/kernels/test_kernel_codegen.py)."""
    return dict(BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n, RH=R // 2, P=P, **dot_mode(dtype))


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def pointer_constexprs(cfg: DecodeConfig, R: int, P: int, page_size: int, sparse: bool, dtype: torch.dtype,
                       multi: bool = False, fp8: bool = False) -> dict:
    """The compile-time arguments of `_stage1_kernel` (shared with tests/kernels/test_kernel_codegen.py); `multi`:
    several query tokens per request, each row with its own causal limit; `fp8`: an FP8 latent cache (q in `dtype`)."""
    return dict(SPARSE=sparse, PS=page_size, R=R, P=P, BLOCK_H=cfg.block_h,
                BLOCK_N=cfg.block_n, RH=max(16, block(R) // 2), BLOCK_P=block(P), MULTI=multi, FP8=fp8,
                **dot_mode(dtype))


@functools.lru_cache(maxsize=1024)  # per call on the host: cached (frozen results, shared)
def fp8_constexprs(cfg: DecodeConfig, R: int, P: int, page_size: int, sparse: bool, dtype: torch.dtype,
                   multi: bool = False) -> dict:
    """The compile-time arguments of `decode_fp8._stage1_fp8_kernel` (its arguments are `_stage1_kernel`'s)."""
    return dict(SPARSE=sparse, PS=page_size, G=R // FP8_GROUP, P=P, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
                BLOCK_P=block(P), MULTI=multi, **dot_mode(dtype))


def _tma_stage1(q_nope, q_pe, ckv_cache, kpe_cache, block_table, sm_scale, o, l, s_on, s_ln, ns, cfg: DecodeConfig):
    """(`_stage1_tma_kernel` bound to its grid and compile-time arguments, its descriptor templates, the numbers
    after its ten tensor arguments): what a call's signature fixes. Launch: `bound(q_nope, q_pe, ckv_cache,
    kpe_cache, ckv_cache, kpe_cache, block_table, seq_lens, o, l, *numbers)` (the first two caches: the bases of the
    descriptors, `_launch.Bound`'s templates), as `decode_wgmma.run_stage1` does."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    B, H, R = q_nope.shape
    NP, PS, _ = ckv_cache.shape
    P = kpe_cache.shape[2]
    templates = without_bases((
        TensorDescriptor(ckv_cache, [NP * PS, R], [slot_stride(ckv_cache), 1], [cfg.block_n, R // 2]),
        TensorDescriptor(kpe_cache, [NP * PS, P], [slot_stride(kpe_cache), 1], [cfg.block_n, P])))
    bound = bind(_stage1_tma_kernel, (B, cdiv(H, cfg.block_h), ns), templated_at(2, templates), n_splits=ns,
                 **tma_constexprs(cfg, R, P, q_nope.dtype), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                 **pdl_launch(q_nope.device))
    numbers = (sm_scale * _LOG2E, H, PS,
               q_nope.stride(0), q_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
               ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1),
               block_table.stride(0), s_on, o.stride(-3), o.stride(-2), s_ln, l.stride(-2), l.stride(-1))
    return bound, templates, numbers


def _pointer_stage1(q_nope, q_pe, ckv_cache, kpe_cache, table, sparse: bool, seq_lens, sm_scale, o, l, s_on, s_ln,
                    ns, cfg: DecodeConfig, n_query: int = 1, ckv_scale=None, merged_into=None):
    """(`_stage1_kernel`, or over an FP8 cache with bf16 / fp16 q `decode_fp8._stage1_fp8_kernel` (the same
    arguments), bound to its grid and compile-time arguments, the numbers after its nine tensor arguments, the
    self-merging launch or None).
    Launch: `bound(q_nope, q_pe, ckv_cache, kpe_cache, table, table if sparse else seq_lens, o, l,
    ckv_scale if FP8 else o, *numbers)` (o: an unread placeholder pointer without FP8).
    `merged_into` (out, lse), final outputs (meta tensors: their strides) of a split call (ns > 1): also
    `_stage1_merged_kernel` bound, as (bound, merge numbers, counter slots); launch `bound(<stage 1's arguments>,
    counters, out, lse, *merge numbers)` (kernels/merge.py, "a split launch that merges itself"). None for the FP8
    kernel and where that launch would not fit one wave (`merge_work`)."""
    B, H, R = q_nope.shape
    P = q_pe.shape[2]
    fp8 = ckv_scale is not None
    s_sp, s_ss = (ckv_scale.stride(0), ckv_scale.stride(1)) if fp8 else (0, 0)
    sqn, sqp, sc, sk, so, sl = (t.stride() for t in (q_nope, q_pe, ckv_cache, kpe_cache, o, l))
    page_size, multi = ckv_cache.shape[1], n_query > 1
    if fp8 and _fp8.fits(R, q_nope.dtype):  # the scales folded into the products (decode_fp8.py)
        kernel = _fp8._stage1_fp8_kernel
        constexprs = fp8_constexprs(cfg, R, P, page_size, sparse, q_nope.dtype, multi)
    else:
        kernel = _stage1_kernel
        constexprs = pointer_constexprs(cfg, R, P, page_size, sparse, q_nope.dtype, multi, fp8)
    bound = bind(kernel, (B, cdiv(H, cfg.block_h), ns), **constexprs, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages, **pdl_launch(q_nope.device))
    numbers = (sm_scale * _LOG2E, H, table.shape[1] if sparse else 0,
               sqn[0], sqn[1], sqp[0], sqp[1], sc[0], sc[1], sk[0], sk[1],
               table.stride(0), s_sp, s_ss,
               s_on, so[-3], so[-2], s_ln, sl[-2], sl[-1],
               ns, *query_limit_args(seq_lens, n_query, H))
    merged = None
    work = merge_work(ns, *merged_into, B * cdiv(H, cfg.block_h), q_nope.device) if merged_into and ns > 1 else None
    if work is not None and kernel is _stage1_kernel:
        work, tail, slots, programs = work
        merged = (bind(_stage1_merged_kernel, (programs,), **constexprs, **work, num_warps=cfg.num_warps,
                       num_stages=cfg.num_stages, **pdl_launch(q_nope.device)), tail, slots)
    return bound, numbers, merged


def _launch_tma(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, o, l, s_on, s_ln, ns,
                cfg: DecodeConfig):
    """One launch of the Triton TMA stage-1 kernel (benchmarks time it alone); returns the compiled kernel."""
    plan = _tma_stage1(q_nope, q_pe, ckv_cache, kpe_cache, block_table, sm_scale, o, l, s_on, s_ln, ns, cfg)
    return _wgmma.run_stage1(plan, q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, o, l)


def _launch_pointer(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, indices, sm_scale, o, l, s_on,
                    s_ln, ns, cfg: DecodeConfig, n_query: int = 1, ckv_scale=None):
    """One launch of the Triton pointer stage-1 kernel (benchmarks time it alone); returns the compiled kernel."""
    sparse = indices is not None
    table = indices if sparse else block_table
    bound, numbers, _ = _pointer_stage1(q_nope, q_pe, ckv_cache, kpe_cache, table, sparse, seq_lens, sm_scale, o, l,
                                        s_on, s_ln, ns, cfg, n_query, ckv_scale)
    return bound(q_nope, q_pe, ckv_cache, kpe_cache, table, table if sparse else seq_lens, o, l,
                 ckv_scale if ckv_scale is not None else o, *numbers)
