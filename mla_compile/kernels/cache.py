"""`mla::cache_write` in Triton: one program per new token scatters its ckv/kpe rows into the paged cache."""

from __future__ import annotations

import triton
import triton.language as tl

from ._util import pdl_enter, pdl_launch


@triton.jit
def _cache_write_kernel(Ckv, Kpe, SrcC, SrcK, Slots, R, P, PS,
                        s_cp, s_cs, s_kp, s_ks, s_sc, s_sk,
                        BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr = False):
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


def cache_write(ckv_cache, kpe_cache, ckv, kpe, slots) -> None:
    T = ckv.shape[0]
    if T == 0:
        return
    ckv = ckv if ckv.stride(-1) == 1 else ckv.contiguous()
    kpe = kpe if kpe.stride(-1) == 1 else kpe.contiguous()
    R, P = ckv.shape[1], kpe.shape[1]
    _cache_write_kernel[(T,)](ckv_cache, kpe_cache, ckv, kpe, slots, R, P, ckv_cache.shape[1],
                              ckv_cache.stride(0), ckv_cache.stride(1), kpe_cache.stride(0), kpe_cache.stride(1),
                              ckv.stride(0), kpe.stride(0),
                              BLOCK_R=triton.next_power_of_2(max(R, 1)), BLOCK_P=triton.next_power_of_2(max(P, 1)),
                              num_warps=4, **pdl_launch(ckv.device))
