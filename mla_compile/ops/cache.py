"""`mla::cache_write`: scatter new latent tokens into the paged cache (in place)."""

from __future__ import annotations

import torch

from . import _checks as C


def check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots):
    C.check_tensor(ckv_cache, "ckv_cache", 3, C.FLOAT_DTYPES)
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
    C.check(ckv.dtype == ckv_cache.dtype, "ckv", f"dtype {ckv.dtype} differs from ckv_cache's {ckv_cache.dtype}")
    C.check(kpe.dtype == kpe_cache.dtype, "kpe", f"dtype {kpe.dtype} differs from kpe_cache's {kpe_cache.dtype}")
    C.check_same_device(dict(ckv_cache=ckv_cache, kpe_cache=kpe_cache, ckv=ckv, kpe=kpe, slots=slots))
    C.check(ckv_cache.is_contiguous(), "ckv_cache", "must be contiguous (written in place through a flat view)")
    C.check(kpe_cache.is_contiguous(), "kpe_cache", "must be contiguous (written in place through a flat view)")
    if not C.is_fake(slots) and C.data_checks_enabled(slots.device) and slots.numel():
        capacity = ckv_cache.shape[0] * ckv_cache.shape[1]
        lo, hi = int(slots.min()), int(slots.max())
        C.check(lo >= -1 and hi < capacity, "slots",
                f"must be -1 (skip) or in [0, {capacity}), saw {lo if lo < -1 else hi}")


@torch.library.custom_op(
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
    """
    check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots)
    keep = slots >= 0
    idx = slots[keep]
    for cache, new in ((ckv_cache, ckv), (kpe_cache, kpe)):
        # explicit sizes: a rope-less kpe_cache [NP, PS, 0] makes view(-1, 0) ambiguous
        cache.view(cache.shape[0] * cache.shape[1], cache.shape[2])[idx] = new[keep]


@cache_write.register_fake
def _(ckv_cache, kpe_cache, ckv, kpe, slots):
    check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots)


@cache_write.register_kernel("cuda")
def _(ckv_cache, kpe_cache, ckv, kpe, slots):
    check_cache_write_args(ckv_cache, kpe_cache, ckv, kpe, slots)
    from ..kernels import dispatch

    dispatch.cache_write(ckv_cache, kpe_cache, ckv, kpe, slots)
