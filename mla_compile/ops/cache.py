"""`mla::cache_write`: scatter new latent tokens into the paged cache (in place)."""

from __future__ import annotations

import torch

from .. import fp8
from . import _checks as C
from ._plans import Plans, dispatch_plan
from ._registry import define


def _views_as_slots(t: torch.Tensor) -> bool:
    """[NP, PS, D] whose rows view as [NP * PS, D]: unit last stride, pages PS rows apart (a contiguous cache, or
    one of the FP8 buffer's column views, fp8.allocate)."""
    NP, PS, D = t.shape
    return (D <= 1 or t.stride(2) == 1) and (NP <= 1 or t.stride(0) == PS * t.stride(1))


@C.once_per_signature
def check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale=None):
    C.check_tensor(ckv_cache, "ckv_cache", 3, C.FLOAT_DTYPES + (fp8.DTYPE,))
    C.check_tensor(kpe_cache, "kpe_cache", 3, C.FLOAT_DTYPES)
    C.check_tensor(ckv, "ckv", 2, C.FLOAT_DTYPES)
    C.check_tensor(kpe, "kpe", 2, C.FLOAT_DTYPES)
    C.check_tensor(slots, "slots", 1, torch.int64)
    C.check_latent_rank(ckv_cache.shape[2], "ckv_cache")
    C.check(kpe_cache.shape[:2] == ckv_cache.shape[:2], "kpe_cache",
            f"pages/page size {tuple(kpe_cache.shape[:2])} differ from ckv_cache {tuple(ckv_cache.shape[:2])}")
    C.check_dim(ckv, "ckv", 1, ckv_cache.shape[2], "ckv_cache.shape[2] (R)")
    C.check_dim(kpe, "kpe", 1, kpe_cache.shape[2], "kpe_cache.shape[2] (P)")
    C.check_dim(kpe, "kpe", 0, ckv.shape[0], "ckv.shape[0] (tokens T)")
    C.check_dim(slots, "slots", 0, ckv.shape[0], "ckv.shape[0] (tokens T)")
    C.check_ckv_scale(ckv_cache, ckv_scale)
    # an FP8 cache quantizes on write: ckv comes in any float dtype (the model's)
    C.check(fp8.is_fp8(ckv_cache) or ckv.dtype == ckv_cache.dtype, "ckv",
            f"dtype {ckv.dtype} differs from ckv_cache's {ckv_cache.dtype}")
    C.check(kpe.dtype == kpe_cache.dtype, "kpe", f"dtype {kpe.dtype} differs from kpe_cache's {kpe_cache.dtype}")
    C.check_same_device(dict(ckv_cache=ckv_cache, kpe_cache=kpe_cache, ckv=ckv, kpe=kpe, slots=slots))
    # an FP8 cache's three views of one buffer (fp8.allocate) are strided: they need only view as [slots, width]
    for t, name in ((ckv_cache, "ckv_cache"), (kpe_cache, "kpe_cache"), (ckv_scale, "ckv_scale")):
        if t is not None:
            C.check(_views_as_slots(t), name, f"must view as [slots, width] (written in place through a flat view), "
                                              f"got strides {t.stride()} for shape {tuple(t.shape)}")
    if not C.is_fake(slots) and C.data_checks_enabled(slots.device) and slots.numel():
        capacity = ckv_cache.shape[0] * ckv_cache.shape[1]
        lo, hi = int(slots.min()), int(slots.max())
        C.check(lo >= -1 and hi < capacity, "slots",
                f"must be -1 (skip) or in [0, {capacity}), saw {lo if lo < -1 else hi}")


def _slot_rows(cache: torch.Tensor) -> torch.Tensor:
    """[NP, PS, D] -> [NP * PS, D] sharing storage (`_views_as_slots` checked); explicit sizes: a rope-less
    kpe_cache [NP, PS, 0] makes view(-1, 0) ambiguous."""
    return cache.as_strided((cache.shape[0] * cache.shape[1], cache.shape[2]), (cache.stride(1), cache.stride(2)))


def _write(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale, scale_fmt=None):
    keep = slots >= 0
    idx = slots[keep]
    writes = [(kpe_cache, kpe[keep])]
    if ckv_scale is None:
        writes.append((ckv_cache, ckv[keep]))
    else:
        values, scales = fp8.quantize(ckv[keep], scale_fmt)
        writes += [(ckv_cache, values), (ckv_scale, scales)]
    for cache, new in writes:
        _slot_rows(cache)[idx] = new


def _check_not_fp8(ckv_cache):
    C.check(not (isinstance(ckv_cache, torch.Tensor) and fp8.is_fp8(ckv_cache)), "ckv_cache",
            f"is {fp8.DTYPE}: an FP8 cache is written by mla::cache_write_fp8 (quantize on write, with its ckv_scale)")


@define(
    "mla::cache_write",
    mutates_args=("ckv_cache", "kpe_cache"),
    device_types="cpu",
    schema="(Tensor(a!) ckv_cache, Tensor(b!) kpe_cache, Tensor ckv, Tensor kpe, Tensor slots) -> ()",
)
def cache_write(ckv_cache, kpe_cache, ckv, kpe, slots):
    """Write T new tokens into the paged latent cache, in place.

    Shapes: ckv_cache [NP, PS, R], kpe_cache [NP, PS, P] (mutated); ckv [T, R], kpe [T, P] (P may be 0:
    rope-less MLA);
    slots int64 [T]: flat slot page * PS + offset, or -1 to skip the token (e.g. owned by another DCP rank).
    A slot given twice ends up holding values of its tokens in no specified mix (as PyTorch's index_put and the
    peers' cache writes): fine for a dummy slot that padding tokens share, never for a slot that is read.
    An FP8 cache is `mla::cache_write_fp8`'s.
    """
    _check_not_fp8(ckv_cache)
    check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots)
    _write(ckv_cache, kpe_cache, ckv, kpe, slots, None)


@cache_write.register_fake
def _(ckv_cache, kpe_cache, ckv, kpe, slots):
    _check_not_fp8(ckv_cache)
    check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots)


@cache_write.register_kernel("cuda")
def _(ckv_cache, kpe_cache, ckv, kpe, slots):
    args = (ckv_cache, kpe_cache, ckv, kpe, slots)
    _PLANS.run(args, (), _check_cache_write, _make_cache_write_plan, args)


def _check_cache_write(ckv_cache, kpe_cache, ckv, kpe, slots):
    _check_not_fp8(ckv_cache)
    check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots)


_make_cache_write_plan = dispatch_plan("cache_write_plan")


_PLANS = Plans()  # one plan per call signature (ops/_plans.py)


# A separate op rather than an optional mutated argument of mla::cache_write: torch-mlir's importer cannot emit an
# auto-functionalized `Tensor(c!)?` left None (a None result type), which every bf16 cache_write would then carry
@define(
    "mla::cache_write_fp8",
    mutates_args=("ckv_cache", "kpe_cache", "ckv_scale"),
    device_types="cpu",
    schema="(Tensor(a!) ckv_cache, Tensor(b!) kpe_cache, Tensor(c!) ckv_scale, Tensor ckv, Tensor kpe, "
           "Tensor slots, str? scale_fmt=None) -> ()",
)
def cache_write_fp8(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt=None):
    """`mla::cache_write` into an FP8 cache (mla_compile/fp8.py), quantizing on write.

    Shapes: ckv_cache float8_e4m3fn [NP, PS, R] (R a multiple of 128), kpe_cache [NP, PS, P], ckv_scale float32
    [NP, PS, R / 128] (all mutated; the three views of one token buffer, or separate tensors); ckv [T, R] in any
    float dtype, quantized per token and 128 channels (`fp8.quantize`), its scales written beside the values;
    kpe [T, P] in kpe_cache's dtype; slots int64 [T] as for `mla::cache_write` (-1 skipped). scale_fmt None: scales
    amax / 448; "ue8m0": powers of two, as DeepSeek's own quantizer writes them (exact for FlashMLA's FP8 kernels;
    mla_compile/fp8.py). Every reader reads either.
    """
    _check_fp8_write(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt)
    _write(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale, scale_fmt)


@cache_write_fp8.register_fake
def _(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt=None):
    _check_fp8_write(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt)


@cache_write_fp8.register_kernel("cuda")
def _(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt=None):
    args = (ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots)
    _FP8_PLANS.run(args, (scale_fmt,), _check_fp8_write, _make_fp8_write_plan, (*args, scale_fmt))


def _check_fp8_write(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt=None):
    fp8.check_scale_fmt(scale_fmt)
    check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale)


_FP8_PLANS = Plans()  # mla::cache_write_fp8 (ops/_plans.py)
_make_fp8_write_plan = dispatch_plan("cache_write_fp8_plan")


# The buffer-level write that compiled code uses: the graph then mutates its input (the token buffer) directly. Through
# mla::cache_write_fp8 on views taken inside the graph, AOTAutograd functionalizes three differently typed views of one
# input, and Inductor copies the views' columns out of the buffer and the buffer back onto itself every step (seen on
# CPU, torch 2.13)
@define(
    "mla::cache_write_fp8_tokens",
    mutates_args=("token_buf",),
    device_types="cpu",
    schema="(Tensor(a!) token_buf, Tensor ckv, Tensor kpe, Tensor slots, str? scale_fmt=None) -> ()",
)
def cache_write_fp8_tokens(token_buf, ckv, kpe, slots, scale_fmt=None):
    """`mla::cache_write_fp8` into an FP8 cache given as its token buffer (mla_compile/fp8.py), quantizing on write.

    Shapes: token_buf uint8 [NP, PS, W] (mutated), W = fp8.token_bytes(R, P, kpe.dtype) (656 for R 512, P 64,
    bf16 rope); ckv [T, R] in any float dtype (R a multiple of 128); kpe [T, P] in the rope dtype the buffer holds;
    slots int64 [T] as for `mla::cache_write` (-1 skipped); scale_fmt as for `mla::cache_write_fp8`. Same bytes as
    `mla::cache_write_fp8` over `fp8.views(token_buf, R, kpe.dtype)`.
    """
    _write(*_token_views(token_buf, ckv, kpe, slots, scale_fmt), scale_fmt)


def _token_views(token_buf, ckv, kpe, slots, scale_fmt=None):
    """(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale) for `_write`, after checking the buffer against ckv / kpe
    and scale_fmt."""
    C.check_tensor(token_buf, "token_buf", 3, (torch.uint8,))
    C.check_tensor(ckv, "ckv", 2, C.FLOAT_DTYPES)
    C.check_tensor(kpe, "kpe", 2, C.FLOAT_DTYPES)
    R, P = ckv.shape[1], kpe.shape[1]
    C.check(R > 0 and R % fp8.GROUP == 0, "ckv", f"an FP8 cache needs R (last dim) a positive multiple of {fp8.GROUP}, "
                                                 f"got {R}")
    C.check(kpe.dtype in fp8.ROPE_DTYPES and P % 2 == 0, "kpe",
            f"the FP8 token keeps the rope part in one of {fp8.ROPE_DTYPES} with an even width, got {kpe.dtype} "
            f"[.., {P}]")
    W = fp8.token_bytes(R, P, kpe.dtype)
    C.check(token_buf.shape[2] == W, "token_buf", f"last dim must be {W} bytes (R {R} e4m3 + {R // fp8.GROUP} float32 "
                                                  f"scales + {P} {kpe.dtype} rope), got {token_buf.shape[2]}")
    C.check(token_buf.is_contiguous(), "token_buf", f"must be contiguous, got strides {token_buf.stride()}")
    ckv_cache, ckv_scale, kpe_cache = fp8.views(token_buf, R, kpe.dtype)
    _check_fp8_write(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt)
    return ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale


@cache_write_fp8_tokens.register_fake
def _(token_buf, ckv, kpe, slots, scale_fmt=None):
    _token_views(token_buf, ckv, kpe, slots, scale_fmt)


@cache_write_fp8_tokens.register_kernel("cuda")
def _(token_buf, ckv, kpe, slots, scale_fmt=None):
    args = (token_buf, ckv, kpe, slots)
    _TOKEN_PLANS.run(args, (scale_fmt,), _token_views, _make_token_write_plan, (*args, scale_fmt))


_TOKEN_PLANS = Plans()  # mla::cache_write_fp8_tokens (ops/_plans.py)


_make_token_write_plan = dispatch_plan("cache_write_fp8_tokens_plan")
