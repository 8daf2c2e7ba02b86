"""Paged latent cache construction: block tables and filling pages from per-request tokens.

Used by the demo, the tests and the benchmarks so that every one of them lays caches out the same way,
and DCP shards are always made through `layout` (never by hand).
"""

from __future__ import annotations

import dataclasses

import torch

from . import fp8, layout

KV_CACHE_DTYPES = ("auto", "fp8_e4m3")  # "auto": the tokens' dtype; "fp8_e4m3": mla_compile/fp8.py's format


@dataclasses.dataclass
class PagedBatch:
    """A batch of requests in a paged latent cache (one rank's view when DCP-sharded)."""

    ckv_cache: torch.Tensor  # [NP, PS, R]
    kpe_cache: torch.Tensor  # [NP, PS, P]
    block_table: torch.Tensor  # int32 [B, MP]
    seq_lens: torch.Tensor  # int32 [B], lengths held in THIS cache (local lengths on a DCP rank)
    ckv_scale: torch.Tensor | None = None  # float32 [NP, PS, R / 128] of an FP8 ckv_cache (mla_compile/fp8.py)

    @property
    def page_size(self) -> int:
        return self.ckv_cache.shape[1]


def make_block_table(seq_lens: list[int], page_size: int, max_pages: int | None = None, *, shuffle: bool = True,
                     spare_pages: int = 0, generator: torch.Generator | None = None,
                     device="cpu") -> tuple[torch.Tensor, int]:
    """Give each request ceil(len / PS) distinct pages (shuffled across the pool, like a real allocator).

    Returns (block_table int32 [B, max_pages], num_pages). Unused entries point at page 0 (never read).
    """
    need = [-(-n // page_size) for n in seq_lens]
    max_pages = max(max_pages or 0, max(need, default=0), 1)
    num_pages = sum(need) + spare_pages + 1
    pool = torch.randperm(num_pages, generator=generator) if shuffle else torch.arange(num_pages)
    table = torch.zeros(len(seq_lens), max_pages, dtype=torch.int32)
    start = 0
    for b, n in enumerate(need):  # per request, not per token
        table[b, :n] = pool[start:start + n].to(torch.int32)
        start += n
    return table.to(device), num_pages


def fill_paged(ckv: list[torch.Tensor], kpe: list[torch.Tensor], page_size: int, *, max_pages: int | None = None,
               shuffle: bool = True, spare_pages: int = 0, generator: torch.Generator | None = None,
               kv_cache_dtype: str = "auto", fp8_scale_fmt: str | None = None) -> PagedBatch:
    """Lay out request b's tokens ckv[b] [L_b, R] / kpe[b] [L_b, P] in a fresh paged cache.

    Unused cache slots hold NaN so a kernel that reads outside the valid tokens is caught by tests.
    kv_cache_dtype "fp8_e4m3": the FP8 format (mla_compile/fp8.py: one [NP, PS, 656]-byte buffer for R 512 / P 64,
    ckv quantized on write, kpe kept in its dtype), its scales in `ckv_scale` (fp8_scale_fmt "ue8m0": powers of two,
    `fp8.quantize`); every byte of an unused slot is 0xFF (NaN in all three views).
    """
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: expected one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    fp8.check_scale_fmt(fp8_scale_fmt, "fp8_scale_fmt")
    lens = [x.shape[0] for x in ckv]
    device, dtype = ckv[0].device, ckv[0].dtype
    table, num_pages = make_block_table(lens, page_size, max_pages, shuffle=shuffle, spare_pages=spare_pages,
                                        generator=generator, device=device)
    R, P = ckv[0].shape[1], kpe[0].shape[1]
    ckv_scale = None
    if kv_cache_dtype == "fp8_e4m3":
        buf, ckv_cache, ckv_scale, kpe_cache = fp8.allocate(num_pages, page_size, R, P, device, kpe[0].dtype)
        buf.fill_(0xFF)  # NaN in the e4m3, float32 and bf16 views alike
    else:
        ckv_cache = torch.full((num_pages, page_size, R), float("nan"), dtype=dtype, device=device)
        kpe_cache = torch.full((num_pages, page_size, P), float("nan"), dtype=dtype, device=device)
    if sum(lens):
        req = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)]).to(device)
        pos = torch.cat([torch.arange(n) for n in lens]).to(device)
        slots = layout.owner_slots(table, req, pos, page_size)
        if ckv_scale is None:
            torch.ops.mla.cache_write(ckv_cache, kpe_cache, torch.cat(ckv), torch.cat(kpe), slots)
        else:
            torch.ops.mla.cache_write_fp8(ckv_cache, kpe_cache, ckv_scale, torch.cat(ckv), torch.cat(kpe), slots,
                                          fp8_scale_fmt)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return PagedBatch(ckv_cache, kpe_cache, table, seq_lens, ckv_scale)


def shard_tokens(tokens: list[torch.Tensor], dcp_size: int, dcp_rank: int) -> list[torch.Tensor]:
    """This rank's tokens of each request, in local order (token t -> rank t % n, local position t // n)."""
    return [x[layout.local_token_positions(x.shape[0], dcp_size, dcp_rank).to(x.device)] for x in tokens]


def fill_sharded(ckv: list[torch.Tensor], kpe: list[torch.Tensor], page_size: int, dcp_size: int, dcp_rank: int,
                 **kwargs) -> PagedBatch:
    """One DCP rank's paged cache of the given (global) requests."""
    return fill_paged(shard_tokens(ckv, dcp_size, dcp_rank), shard_tokens(kpe, dcp_size, dcp_rank), page_size,
                      **kwargs)
