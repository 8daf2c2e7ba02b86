"""`mla::cache_write` in Triton: one program per new token scatters its ckv/kpe rows into the paged cache."""

from __future__ import annotations

import triton
import triton.language as tl

from .. import fp8
from ._util import next_power_of_2, pdl_enter, pdl_launch
from ._launch import bind


@triton.jit
def _cache_write_kernel(Ckv, Kpe, SrcC, SrcK, Slots, Scale, SrcS, R, P, PS, G,
                        s_cp, s_cs, s_kp, s_ks, s_sc, s_sk, s_gp, s_gs, s_ss,
                        BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
                        FP8: tl.constexpr = False, PDL: tl.constexpr = False):
    """FP8: SrcC holds the already quantized e4m3 values and SrcS their G float32 scales per token
    (`fp8.quantize`, the format's one definition), scattered beside them into Scale."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    if slot >= 0:  # -1: token owned by another DCP rank (or padding)
        page = slot // PS
        off = slot % PS
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        c = tl.load(SrcC + t * s_sc + offs_r, mask=offs_r < R)
        tl.store(Ckv + page * s_cp + off * s_cs + offs_r, c, mask=offs_r < R)
        k = tl.load(SrcK + t * s_sk + offs_p, mask=offs_p < P)
        tl.store(Kpe + page * s_kp + off * s_ks + offs_p, k, mask=offs_p < P)
        if FP8:
            offs_g = tl.arange(0, BLOCK_G)
            s = tl.load(SrcS + t * s_ss + offs_g, mask=offs_g < G)
            tl.store(Scale + page * s_gp + off * s_gs + offs_g, s, mask=offs_g < G)


def _write_launch(ckv_cache, kpe_cache, ckv, kpe, dst_s, scales, fp8: bool):
    """(`_cache_write_kernel` bound for these tensors' signature, the numbers after its seven tensor arguments):
    `bound(ckv_cache, kpe_cache, ckv, kpe, slots, dst_s, scales, *numbers)`; without FP8, dst_s and scales are
    unread placeholders (the cache and ckv)."""
    R, P = ckv.shape[1], kpe.shape[1]
    G = scales.shape[1] if fp8 else 1
    bound = bind(_cache_write_kernel, (ckv.shape[0],), BLOCK_R=next_power_of_2(max(R, 1)),
                 BLOCK_P=next_power_of_2(max(P, 1)), BLOCK_G=next_power_of_2(G), FP8=fp8, num_warps=4,
                 **pdl_launch(ckv.device))
    return bound, (R, P, ckv_cache.shape[1], G, ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0),
                   kpe_cache.stride(1), ckv.stride(0), kpe.stride(0), dst_s.stride(0), dst_s.stride(1),
                   scales.stride(0))


def cache_write_plan(ckv_cache, kpe_cache, ckv, kpe, slots):
    """`plan(ckv_cache, kpe_cache, ckv, kpe, slots)` writes any fp16 / bf16 / fp32 call of this signature (ops/
    _plans.py): one bound launch."""
    if ckv.shape[0] == 0:
        return lambda *tensors: None
    copy_c, copy_k = ckv.stride(-1) != 1, kpe.stride(-1) != 1
    bound, numbers = _write_launch(ckv_cache, kpe_cache, ckv.contiguous() if copy_c else ckv,
                                   kpe.contiguous() if copy_k else kpe, ckv_cache, ckv, False)

    def plan(ckv_cache, kpe_cache, ckv, kpe, slots):
        ckv = ckv.contiguous() if copy_c else ckv
        bound(ckv_cache, kpe_cache, ckv, kpe.contiguous() if copy_k else kpe, slots, ckv_cache, ckv, *numbers)

    return plan


def cache_write_fp8_plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots):
    """`plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots)` writes any FP8 call of this signature (ops/_plans.py):
    `fp8.quantize` (device ops) and one bound launch."""
    if ckv.shape[0] == 0:
        return lambda *tensors: None
    copy_k = kpe.stride(-1) != 1
    q, scales = fp8.quantize(ckv)  # this signature's quantized rows: their strides
    bound, numbers = _write_launch(ckv_cache, kpe_cache, q, kpe.contiguous() if copy_k else kpe, ckv_scale, scales,
                                   True)

    def plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots):
        q, scales = fp8.quantize(ckv)
        bound(ckv_cache, kpe_cache, q, kpe.contiguous() if copy_k else kpe, slots, ckv_scale, scales, *numbers)

    return plan


def cache_write(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale=None) -> None:
    """ckv_scale given: an FP8 cache; ckv is quantized here by `fp8.quantize` (device ops, no host sync) and the
    kernel scatters values and scales."""
    if ckv_scale is None:
        return cache_write_plan(ckv_cache, kpe_cache, ckv, kpe, slots)(ckv_cache, kpe_cache, ckv, kpe, slots)
    if ckv.shape[0] == 0:
        return
    ckv, scales = fp8.quantize(ckv)
    kpe = kpe if kpe.stride(-1) == 1 else kpe.contiguous()
    bound, numbers = _write_launch(ckv_cache, kpe_cache, ckv, kpe, ckv_scale, scales, True)
    bound(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale, scales, *numbers)
