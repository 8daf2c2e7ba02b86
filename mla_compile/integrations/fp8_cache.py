"""The FP8 latent cache behind our HF caches' `kv_cache_dtype="fp8_e4m3"` (the format: `mla_compile/fp8.py`).

A layer's cache is ONE uint8 token buffer [NP, PS, W]: per token the R latent values in e4m3, R / 128 float32 scales,
the P rope values in the model's dtype (W = 656 bytes for R 512, P 64 and a bf16 model; 784 for an fp32 model). The
cache's `update` quantizes the new tokens on write (`mla::cache_write_fp8_tokens`, the buffer itself mutated) and
returns `mla_hf::gather_latent` over the buffer's three views with the scales: the latent dequantized to the model's
dtype, so eager HF attention runs over exactly what the cache holds (the reference the compiled rewrite must match).
Under `backend="mla_dcp"` the pass reads the views and scales straight into `mla.decode` / `mla.dcp_decode` /
`mla.sparse_decode` (their `ckv_scale`): nothing is dequantized outside the attention.

The views are taken from the buffer inside whatever runs the step, for reading only (`fp8.views` / `fp8.read_views`:
why, under torch.compile).
"""

from __future__ import annotations

import torch

from .. import fp8
from ..paged import KV_CACHE_DTYPES

FP8 = "fp8_e4m3"


def check_kv_cache_dtype(kv_cache_dtype) -> bool:
    """True for the FP8 cache, False for the model's dtype ("auto" or None); ValueError naming the argument else."""
    if kv_cache_dtype is None:
        return False
    if not (isinstance(kv_cache_dtype, str) and kv_cache_dtype in KV_CACHE_DTYPES):
        raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES} (or None: the model's dtype), got "
                         f"{kv_cache_dtype!r}")
    return kv_cache_dtype == FP8


def allocate(num_pages: int, page_size: int, R: int, P: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A zeroed token buffer uint8 [num_pages, page_size, W] for latent width R, rope width P kept in `dtype`."""
    if dtype not in fp8.ROPE_DTYPES:
        raise ValueError(f"kv_cache_dtype: '{FP8}' keeps the rope part in the model's dtype, one of "
                         f"{fp8.ROPE_DTYPES}; this model runs in {dtype}")
    fp8.groups(R)  # R a multiple of 128 (ValueError naming R otherwise)
    return fp8.allocate(num_pages, page_size, R, P, device, dtype)[0]


def write(buf: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, slots: torch.Tensor, scale_fmt=None) -> None:
    """Quantize and write tokens ckv [T, R] / kpe [T, P] (in the buffer's rope dtype) at slots int64 [T] (-1
    skipped); scale_fmt "ue8m0": power-of-two scales (`fp8.quantize`)."""
    torch.ops.mla.cache_write_fp8_tokens(buf, ckv, kpe, slots, scale_fmt)


def check_scale_fmt(fp8_scale_fmt, is_fp8: bool):
    """fp8_scale_fmt for a cache: None, or "ue8m0" with the FP8 cache (ValueError naming the argument else)."""
    if fp8_scale_fmt is not None:
        fp8.check_scale_fmt(fp8_scale_fmt, "fp8_scale_fmt")
        if not is_fp8:
            raise ValueError(f"fp8_scale_fmt: {fp8_scale_fmt!r} is for kv_cache_dtype={FP8!r} (a cache in the "
                             f"model's dtype has no scales)")
    return fp8_scale_fmt


def gather(buf: torch.Tensor, R: int, kpe_dtype: torch.dtype, block_table: torch.Tensor, max_len: int,
           dcp_size: int, dcp_rank: int, group_name: str, heads_sharded: bool = False):
    """`mla_hf::gather_latent` over the buffer's views: the dequantized latent [B, 1, max_len, R] and the rope
    latent [B, 1, max_len, P], both in kpe_dtype (the rope part's dtype: the model's)."""
    ckv, scale, kpe = fp8.read_views(buf, R, kpe_dtype)
    return torch.ops.mla_hf.gather_latent(ckv, kpe, block_table, max_len, dcp_size, dcp_rank, group_name, scale,
                                          heads_sharded)


def tokens_per_gib(R: int = 512, P: int = 64, dtype: torch.dtype = torch.bfloat16, kv_cache_dtype: str = FP8) -> int:
    """Latent tokens one GiB holds (per layer, per rank): FP8 tokens count their scales; "auto" is R + P values of
    `dtype`."""
    per_token = (fp8.token_bytes(R, P, dtype) if check_kv_cache_dtype(kv_cache_dtype)
                 else (R + P) * dtype.itemsize)
    return (1 << 30) // per_token
