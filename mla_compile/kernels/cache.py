"""`mla::cache_write` in Triton: one program per new token scatters its ckv/kpe rows into the paged cache."""

from __future__ import annotations

import triton
import triton.language as tl

from .. import fp8
from ._util import next_power_of_2, pdl_enter, pdl_launch
from ._launch import bind


@triton.jit
def _cache_write_kernel(Ckv, Kpe, SrcC, SrcK, Slots, Scale, R, P, PS, G,
                        s_cp, s_cs, s_kp, s_ks, s_sc, s_sk, s_gp, s_gs,
                        BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_G: tl.constexpr,
                        FP8: tl.constexpr = False, TOKENS: tl.constexpr = False, UE8M0: tl.constexpr = False,
                        PDL: tl.constexpr = False):
    """FP8: each row of SrcC quantized here exactly as `fp8.quantize` (the format's one definition) does
    (`_quantize_row`; R a multiple of 128, BLOCK_G = BLOCK_R / 128), its e4m3 values into Ckv and its G float32
    scales into Scale: one launch, no quantize ops before it (UE8M0: power-of-two scales, `fp8.quantize`'s
    scale_fmt "ue8m0"). Otherwise Scale is an unread placeholder.
    TOKENS (with FP8): Ckv is the token buffer itself (uint8 [NP, PS, W], s_cp / s_cs in bytes; mla_compile/fp8.py:
    a token's R e4m3 bytes, its G float32 scales, its P rope values in SrcK's dtype), the scales' and the rope's
    addresses taken inside it, so a call needs no typed views of it; Kpe and Scale are unread placeholders."""
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t)
    if slot >= 0:  # -1: token owned by another DCP rank (or padding)
        page = slot // PS
        off = slot % PS
        offs_r = tl.arange(0, BLOCK_R)
        offs_p = tl.arange(0, BLOCK_P)
        if FP8:
            q, s = _quantize_row(SrcC, t, s_sc, R, BLOCK_R, BLOCK_G, UE8M0)
            c = q.to(Ckv.dtype.element_ty, bitcast=True)
        else:
            c = tl.load(SrcC + t * s_sc + offs_r, mask=offs_r < R)
        row = Ckv + page * s_cp + off * s_cs
        tl.store(row + offs_r, c, mask=offs_r < R)
        if TOKENS:  # the token's rope after its values and scales, its scales after its values
            kpe_row = (row + R + 4 * G).to(tl.pointer_type(SrcK.dtype.element_ty), bitcast=True)
            scale_row = (row + R).to(tl.pointer_type(tl.float32), bitcast=True)
        else:
            kpe_row = Kpe + page * s_kp + off * s_ks
            scale_row = Scale + page * s_gp + off * s_gs
        k = tl.load(SrcK + t * s_sk + offs_p, mask=offs_p < P)
        tl.store(kpe_row + offs_p, k, mask=offs_p < P)
        if FP8:
            offs_g = tl.arange(0, BLOCK_G)
            tl.store(scale_row + offs_g, s, mask=offs_g < G)


@triton.jit
def _e4m3_bits(x):
    """float32 x (|x| <= 448 or NaN) -> its float8_e4m3fn byte (uint32 0..255) rounded to nearest even, in integer
    operations only: the same bytes on a GPU and under the interpreter (whose float8 cast does not round to even),
    equal to torch's `.to(torch.float8_e4m3fn)` (tests/kernels/test_triton_interpret.py `check_fp8_write`)."""
    b = x.to(tl.uint32, bitcast=True)
    sign = (b >> 31) << 7
    a = b & 0x7FFFFFFF
    # normal e4m3 (|x| >= 2^-6): keep 3 of float32's 23 mantissa bits, ties to even; a carry moves the exponent
    r = a + 0x7FFFF + ((a >> 20) & 1)
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal e4m3 (|x| < 2^-6): k = |x| / 2^-9 rounded to even, 0..8 (8 is the smallest normal's byte, 0x08);
    # |x| * 2^9 = mant * 2^(E - 141) for the 24-bit mantissa mant and float32 exponent E <= 120
    E = (a >> 23).to(tl.int32)
    mant = (a & 0x7FFFFF) | 0x800000
    s = tl.minimum(141 - E, 25).to(tl.uint32)  # shifts past 25 leave nothing (mant < 2^24): clamped, defined
    k = mant >> s
    rem = mant & ((1 << s) - 1)
    half = 1 << (s - 1)
    k = k + ((rem > half) | ((rem == half) & ((k & 1) == 1))).to(tl.uint32)
    k = tl.where(E == 0, 0, k)  # float32 zeros and subnormals: 0
    mag = tl.where(a >= 0x3C800000, normal, k)
    return sign | tl.where(a > 0x7F800000, 0x7F, mag)


@triton.jit
def _quantize_row(SrcC, t, s_sc, R, BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, UE8M0: tl.constexpr):
    """Token t's latent row as `fp8.quantize` defines it: (e4m3 bytes [BLOCK_R] as uint8, float32 scales [BLOCK_G]):
    per 128 channels, scale = amax / 448 (1 where amax is 0; NaN propagates), value = clamp(x / scale, +-448),
    both divisions correctly rounded. UE8M0: scale = the smallest power of two >= max(amax / 448, 1e-4), from its
    bits as `fp8.pow2_ceil`."""
    offs = tl.arange(0, BLOCK_R)
    x = tl.load(SrcC + t * s_sc + offs, mask=offs < R, other=0.0).to(tl.float32)
    xg = tl.reshape(x, (BLOCK_G, 128))
    amax = tl.reduce(tl.abs(xg), 1, _max_nan)
    ratio = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    if UE8M0:
        ratio = tl.where(ratio < fp8.UE8M0_MIN_SCALE, fp8.UE8M0_MIN_SCALE, ratio)  # NaN compares false: kept
        bits = ratio.to(tl.int32, bitcast=True)
        up = ((bits & 0x7F800000) + 0x00800000).to(tl.float32, bitcast=True)
        # inf (mantissa 0) stays; NaN stays (its exponent bits are inf's: `up` would be wrong)
        scale = tl.where(((bits & 0x007FFFFF) == 0) | (ratio != ratio), ratio, up)
    else:
        scale = tl.where(amax == 0, 1.0, ratio)
    q = tl.math.div_rn(xg, tl.broadcast_to(scale[:, None], xg.shape))
    q = tl.where(q != q, q, tl.minimum(tl.maximum(q, -448.0), 448.0))  # clamp, NaN kept
    return tl.reshape(_e4m3_bits(q), (BLOCK_R,)).to(tl.uint8), scale


@triton.jit
def _max_nan(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


def _write_launch(ckv_cache, kpe_cache, ckv, kpe, ckv_scale=None, tokens: bool = False, scale_fmt=None):
    """(`_cache_write_kernel` bound for these tensors' signature, the numbers after its six tensor arguments):
    `bound(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale or ckv_cache, *numbers)`; ckv_scale given: an FP8 cache,
    the rows quantized in the kernel (scale_fmt: `fp8.quantize`'s); tokens: ckv_cache is an FP8 token buffer (the
    kernel's TOKENS)."""
    R, P = ckv.shape[1], kpe.shape[1]
    fp8_cache = ckv_scale is not None
    block_r = next_power_of_2(max(R, 1))
    bound = bind(_cache_write_kernel, (ckv.shape[0],), BLOCK_R=block_r, BLOCK_P=next_power_of_2(max(P, 1)),
                 BLOCK_G=block_r // fp8.GROUP if fp8_cache else 1, FP8=fp8_cache, TOKENS=tokens,
                 UE8M0=fp8_cache and scale_fmt == fp8.UE8M0, num_warps=4,
                 **pdl_launch(ckv.device))
    scale_strides = (ckv_scale.stride(0), ckv_scale.stride(1)) if fp8_cache else (0, 0)
    return bound, (R, P, ckv_cache.shape[1], fp8.groups(R) if fp8_cache else 1, ckv_cache.stride(0),
                   ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1), ckv.stride(0), kpe.stride(0),
                   *scale_strides)


def cache_write_plan(ckv_cache, kpe_cache, ckv, kpe, slots):
    """`plan(ckv_cache, kpe_cache, ckv, kpe, slots)` writes any fp16 / bf16 / fp32 call of this signature (ops/
    _plans.py): one bound launch."""
    if ckv.shape[0] == 0:
        return lambda *tensors: None
    copy_c, copy_k = ckv.stride(-1) != 1, kpe.stride(-1) != 1
    bound, numbers = _write_launch(ckv_cache, kpe_cache, ckv.contiguous() if copy_c else ckv,
                                   kpe.contiguous() if copy_k else kpe)

    def plan(ckv_cache, kpe_cache, ckv, kpe, slots):
        ckv = ckv.contiguous() if copy_c else ckv
        bound(ckv_cache, kpe_cache, ckv, kpe.contiguous() if copy_k else kpe, slots, ckv_cache, *numbers)

    return plan


def cache_write_fp8_plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt=None):
    """`plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots)` writes any FP8 call of this signature (ops/_plans.py):
    one launch that quantizes each row as `fp8.quantize(row, scale_fmt)` defines (`_quantize_row`, bit-exact) and
    scatters it."""
    if ckv.shape[0] == 0:
        return lambda *tensors: None
    copy_c, copy_k = ckv.stride(-1) != 1, kpe.stride(-1) != 1
    bound, numbers = _write_launch(ckv_cache, kpe_cache, ckv.contiguous() if copy_c else ckv,
                                   kpe.contiguous() if copy_k else kpe, ckv_scale, scale_fmt=scale_fmt)

    def plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots):
        ckv = ckv.contiguous() if copy_c else ckv
        bound(ckv_cache, kpe_cache, ckv, kpe.contiguous() if copy_k else kpe, slots, ckv_scale, *numbers)

    return plan


def cache_write_fp8_tokens_plan(token_buf, ckv, kpe, slots, scale_fmt=None):
    """`plan(token_buf, ckv, kpe, slots)` writes any `mla::cache_write_fp8_tokens` call of this signature into the
    contiguous token buffer uint8 [NP, PS, W] itself (the kernel's TOKENS: no views of it a call), quantizing as
    `cache_write_fp8_plan` does. P > 0."""
    if ckv.shape[0] == 0:
        return lambda *tensors: None
    copy_c, copy_k = ckv.stride(-1) != 1, kpe.stride(-1) != 1
    # the buffer stands in for the three caches: its strides are the rows' (bytes), the scales' and rope's unread
    bound, numbers = _write_launch(token_buf, token_buf, ckv.contiguous() if copy_c else ckv,
                                   kpe.contiguous() if copy_k else kpe, token_buf, tokens=True, scale_fmt=scale_fmt)

    def plan(token_buf, ckv, kpe, slots):
        ckv = ckv.contiguous() if copy_c else ckv
        bound(token_buf, token_buf, ckv, kpe.contiguous() if copy_k else kpe, slots, token_buf, *numbers)

    return plan


def cache_write(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale=None, scale_fmt=None) -> None:
    """One call: its plan made and run (ckv_scale given: an FP8 cache, the rows quantized in the kernel)."""
    if ckv_scale is None:
        cache_write_plan(ckv_cache, kpe_cache, ckv, kpe, slots)(ckv_cache, kpe_cache, ckv, kpe, slots)
    else:
        cache_write_fp8_plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt)(
            ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots)
