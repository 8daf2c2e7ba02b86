"""The FP8 latent cache format: one home for its layout, quantization and dequantization.

Per token (DeepSeek-V3.2's 656-byte token, the layout FlashMLA's FP8 sparse kernels read: kernels/flashmla_fp8.py hands
our caches to them in place when decode_kernel="flashmla" is asked for, or by auto at 128 heads for caches written with
power-of-two scales under Tuning.fp8_scale_fmt "ue8m0"):

    bytes   0 .. 511   the R = 512 latent values as float8_e4m3fn
    bytes 512 .. 527   R / 128 = 4 float32 scales, one per group of 128 latent channels
    bytes 528 .. 655   the P = 64 rope values as bfloat16 (not quantized: rope carries the position signal)

Storage is ONE uint8 buffer [NP, PS, R + 4 * R / 128 + 2 * P] per layer, seen through three strided views (no copy):

    ckv       = buf[..., :R].view(float8_e4m3fn)             [NP, PS, R]        strides (PS * W, W, 1)
    ckv_scale = buf[..., R:R + 4G].view(float32)             [NP, PS, G]        strides (PS * W / 4, W / 4, 1)
    kpe       = buf[..., R + 4G:].view(bfloat16)             [NP, PS, P]        strides (PS * W / 2, W / 2, 1)

(W the token width in bytes, G = R / 128.) The float32 / bfloat16 views need W and the view offsets to be
multiples of 4 / 2 bytes: R is a multiple of 128, so R and 4G are multiples of 4 and W = R + 4G + 2P is one when
P is even. Refused: R not a positive multiple of 128, P odd or negative. The rope values may also be kept in
float16 / float32 (`allocate(rope_dtype=...)`, for q of that dtype: the ops take kpe_cache in q's dtype); float64
is refused (R + 4G is not a multiple of 8 bytes for R = 512).

Quantization of one token's latent x [R] (float32 math), per group g of 128 channels:
    scale_g = amax(|x_g|) / 448          (448 = e4m3's largest finite value; a float32 division, correctly rounded)
    scale_g = 1 where amax is 0          (an all-zero group: any scale stores zeros; 1 keeps dequantize finite)
    q_g     = e4m3(clamp(x_g / scale_g, -448, 448))   (round to nearest even; the clamp keeps the division's last
                                                       ulp from overflowing to NaN, e4m3fn has no infinity)
Power-of-two scales (`scale_fmt="ue8m0"`, DeepSeek's own quantizer: FlashMLA's tests/quant.py, V3.2's `scale_fmt`),
per group: scale_g = 2^ceil(log2(max(amax / 448, 1e-4))), the smallest power of two >= max(amax / 448, 1e-4) taken
exactly from the float32 bits (a float32 log2 may round a quotient a few ulps above a power of two down to it; the
quantizer's torch code then takes the lower power and its values round back to 448: the bytes differ only there);
q_g = e4m3(x_g / scale_g) (exact division; |x_g / scale_g| <= 448). An all-zero group gets 2^-13. Same token layout
(the scales stay float32), so every reader reads both; value x scale is then exact in bf16, which is what FlashMLA's
FP8 kernels assume. Costs: a group's largest value lands in (224, 448] instead of at 448; e4m3's relative step is
the same there, so only values near its subnormal range lose bits.

Dequantization, the definition every decode implementation reads the cache by: float32(q) * scale (a float32
product; the float64 reference precision computes it in float64). A non-finite x gives a non-finite scale: NaN in,
NaN out, never a silently finite token.

Readers: the ops' CPU impls dequantize exactly as above; with bf16 / fp16 q the Triton kernel of
kernels/decode_fp8.py never forms the product: value x scale enters as scale x (q . values) and
(p x scale) . values, the scales applied in float32 to the products (fp16 MMAs on the exact e4m3 values); with fp32
q the pointer kernel (kernels/decode_stage1.py) forms the float32 product in registers for fp32 MMAs; the swap-AB
Gluon kernel (kernels/decode_fp8_swapab.py) applies the scales to fp32 products too; FlashMLA's V3.2 kernel
(kernels/flashmla_fp8.py) dequantizes in bf16 (exact only for power-of-two scales, `scale_fmt="ue8m0"`, which
DeepSeek's own quantizer uses; amax / 448 maps each group's largest value to 448, the top of the range, and is not).
Under torch.compile, pass the buffer and take the views inside the compiled function (`views`: why there).

Capacity: 656 bytes a token against 1152 for a bf16 cache (2 * (512 + 64)): 1.76x the tokens per GiB (the scales
cost 16 bytes, 2.4% of the FP8 token).
"""

from __future__ import annotations

import torch

DTYPE = torch.float8_e4m3fn
GROUP = 128  # latent channels per scale
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
SCALE_DTYPE = torch.float32
ROPE_DTYPE = torch.bfloat16
UE8M0 = "ue8m0"  # power-of-two scales (the module docstring); None: amax / 448
SCALE_FMTS = (None, UE8M0)
UE8M0_MIN_SCALE = 1e-4  # DeepSeek's quantizer's floor under amax / 448 (its FP8_AMAX_MARGIN), before the power of two


def check_scale_fmt(scale_fmt, name: str = "scale_fmt") -> None:
    """ValueError naming the argument (`name`) unless scale_fmt is one of SCALE_FMTS."""
    if not (scale_fmt is None or isinstance(scale_fmt, str) and scale_fmt in SCALE_FMTS):
        raise ValueError(f"{name}: expected None (amax / 448 scales) or {UE8M0!r} (power-of-two scales), got "
                         f"{scale_fmt!r}")


def is_fp8(t: torch.Tensor) -> bool:
    """A latent cache (or values) in this format's value dtype."""
    return t.dtype == DTYPE


def groups(R: int) -> int:
    """Scales per token for latent width R (a positive multiple of GROUP; ValueError naming R otherwise)."""
    if not (isinstance(R, (int, torch.SymInt)) and R > 0 and R % GROUP == 0):  # SymInt: traced with dynamic shapes
        raise ValueError(f"R: the FP8 latent cache needs a kv_lora_rank that is a positive multiple of {GROUP} (one "
                         f"scale per {GROUP} channels), got {R!r}")
    return R // GROUP


ROPE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def token_bytes(R: int = 512, P: int = 64, rope_dtype: torch.dtype = ROPE_DTYPE) -> int:
    """Bytes a token takes: R e4m3 values, R / 128 float32 scales, P rope values (656 for 512 / 64, bf16)."""
    if not (isinstance(P, (int, torch.SymInt)) and P >= 0 and P % 2 == 0):
        raise ValueError(f"P: the FP8 latent cache needs an even rope dim >= 0 (the token must stay 4-byte "
                         f"aligned for the scales' view), got {P!r}")
    if rope_dtype not in ROPE_DTYPES:
        raise ValueError(f"rope_dtype: expected one of {ROPE_DTYPES}, got {rope_dtype}")
    return R + 4 * groups(R) + rope_dtype.itemsize * P


def allocate(num_pages: int, page_size: int, R: int = 512, P: int = 64, device="cpu",
             rope_dtype: torch.dtype = ROPE_DTYPE):
    """(buf uint8 [NP, PS, W], ckv e4m3 [NP, PS, R], ckv_scale float32 [NP, PS, R / 128], kpe rope_dtype
    [NP, PS, P]): the three views share buf's memory. Zero-filled, so every scale starts finite
    (dequantize(0, 0) = 0)."""
    buf = torch.zeros(num_pages, page_size, token_bytes(R, P, rope_dtype), dtype=torch.uint8, device=device)
    return (buf, *views(buf, R, rope_dtype))


def views(buf: torch.Tensor, R: int = 512, rope_dtype: torch.dtype = ROPE_DTYPE):
    """(ckv, ckv_scale, kpe) views of a token buffer uint8 [NP, PS, W] (P follows from W): each a column slice of
    the buffer reinterpreted, so each covers exactly its own bytes (safe to write through, also compiled).

    Under torch.compile, make the views INSIDE the compiled function from the buffer as its input: AOTAutograd
    refuses graph inputs that alias one another with different dtypes when one is mutated ("input mutations on
    views with different dtypes", torch 2.13), which is what passing the three views to a compiled step that runs
    `mla::cache_write` gives; views taken inside the graph are functionalized like any other. Compiled code that
    runs every step should write with `mla::cache_write_fp8_tokens` (the buffer itself mutated) and read through
    `read_views`: Inductor lowers a dtype view that changes the item size of a non-contiguous slice (the scales',
    the rope part's) as a contiguous copy, of the whole cache, every step."""
    G = groups(R)
    return (buf[..., :R].view(DTYPE), buf[..., R:R + 4 * G].view(SCALE_DTYPE), buf[..., R + 4 * G:].view(rope_dtype))


def read_views(buf: torch.Tensor, R: int = 512, rope_dtype: torch.dtype = ROPE_DTYPE):
    """`views`' three tensors (same sizes, strides, offsets), made the other way round: the whole buffer
    reinterpreted, then sliced, which Inductor keeps as views (no copy). READ ONLY under torch.compile: each of
    these aliases the whole buffer, and AOTAutograd's write-back of a mutated one then loses the other views'
    writes of the same graph (seen with cache_write_fp8 through them, backend aot_eager, torch 2.13: only the
    scales survived). Write with `mla::cache_write_fp8_tokens`."""
    G = groups(R)
    rope = (R + 4 * G) // rope_dtype.itemsize
    return buf.view(DTYPE)[..., :R], buf.view(SCALE_DTYPE)[..., R // 4:R // 4 + G], buf.view(rope_dtype)[..., rope:]


def quantize(x: torch.Tensor, scale_fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R] (any float dtype) -> (q e4m3 [..., R], scale float32 [..., R / 128]) as the module docstring
    defines; scale_fmt "ue8m0": power-of-two scales. Device ops only (no host sync: usable inside a captured CUDA
    graph)."""
    check_scale_fmt(scale_fmt)
    R = x.shape[-1]
    G = groups(R)
    xg = x.to(torch.float32).reshape(*x.shape[:-1], G, GROUP)
    amax = xg.abs().amax(-1)
    # a tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal (1 ulp off the correctly
    # rounded quotient the format defines, and unlike the CPU), an elementwise division rounds correctly everywhere
    ratio = amax / torch.full_like(amax, E4M3_MAX)
    if scale_fmt == UE8M0:
        scale = pow2_ceil(torch.where(ratio < UE8M0_MIN_SCALE, torch.full_like(ratio, UE8M0_MIN_SCALE), ratio))
    else:
        scale = torch.where(amax == 0, torch.ones_like(amax), ratio)
    q = (xg / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(DTYPE)
    return q.reshape(x.shape), scale


def pow2_ceil(s: torch.Tensor) -> torch.Tensor:
    """float32 s (positive normal, inf or NaN) -> the smallest power of two >= s, read off its bits (exact: no log2);
    inf and NaN stay."""
    bits = s.view(torch.int32)
    up = (bits & 0x7F800000) + 0x00800000  # the next exponent, mantissa 0
    out = torch.where((bits & 0x007FFFFF) == 0, bits, up).view(torch.float32)
    return torch.where(torch.isfinite(s), out, s)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q e4m3 [..., R], scale float32 [..., R / 128]) -> [..., R] in `dtype` (float32, or float64 for the
    reference precision: the product then computed in float64)."""
    dt = torch.float64 if dtype == torch.float64 else torch.float32
    R = q.shape[-1]
    G = groups(R)
    v = q.to(dt).reshape(*q.shape[:-1], G, GROUP) * scale.to(dt)[..., None]
    return v.reshape(q.shape).to(dtype)
