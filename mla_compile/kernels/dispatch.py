"""CUDA entry points of the ops. Each picks a kernel backend; the ops have already validated the inputs.

Registration: the ops stay `custom_op` + `register_kernel("cuda")` (not `triton_op` + `wrap_triton`). Each
op is then one opaque extern node to Inductor, which is what a hand-tuned attention kernel wants (nothing
to fuse across it), the impl may pick a backend at run time (Triton, Gluon, FlashMLA or FlashInfer: the last
two are no Triton kernels and could not be traced by `triton_op`), and CUDA graphs capture the launches as they
are since no impl syncs with the host.

Which decode kernel runs is decided in one place, `select_decode_kernel` (its docstring has the table);
`decode_kernel` gathers a call's facts for it. The choice can be overridden per compiled model
(`options={"decode_kernel": ...}`, mla_compile/tuning.py) or process-wide (MLA_COMPILE_DECODE_BACKEND).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import torch

from .. import fp8
from .. import tuning as _tuning
from . import _gluon
from . import cache as _cache
from . import decode as _decode
from . import decode_fp8_swapab as _fp8_swapab
from . import decode_seesaw as _seesaw
from . import decode_swapab as _swapab
from . import decode_wgmma as _wgmma
from . import dsa as _dsa
from . import flashinfer_mla as _fi
from . import flashmla as _fmla
from . import flashmla_fp8 as _fm8
from . import linear as _linear
from . import merge as _merge
from .rope_less import rope_less, with_zero_rope, zero_rope_column, zero_rope_run

MANY_HEADS = 64  # the Gluon kernels' head block (one warpgroup MMA's M): fewer heads would leave it part empty
# several query tokens per request (rows = S x heads): the Gluon kernels from 32 rows (H 16 x S 2) on, a limit per
# row; a 64-row block reads each KV tile once for all its rows at the warpgroup MMA's rate. H200 2026-12-02, B 8 32K,
# CUDA-graph replay (benchmarks/RESULTS.md): H 16 S 2 / S 4 decode_wgmma 94.5 / 103.8 us (S 1 88.4), the seesaw
# kernel 113.2 / 118.1, the Triton pointer kernel 166.7 / 228.9; H 128 S 2 / S 4 the seesaw 310.0 / 589.3 (S 1
# 168.8), decode_wgmma 337.4 / 679.7, the pointer kernel 841.5 / 1659.2. So one head block (<= 64 rows) takes
# decode_wgmma, more the seesaw
MULTI_TOKEN_GLUON_ROWS = 32
# FlashMLA (through kernels/flashmla.py, what auto would run) beats ours where many heads meet many tokens: H200
# 2026-12-02 (benchmarks/RESULTS.md, CUDA-graph replay, H 128): from 256K tokens (batch x kv) ours takes 1.06-1.31x
# the adapter's time (B 8 32K 176.8 vs 159.2 us, B 32 8K 178.6 vs 168.7, B 128 32K 2754 vs 2110); at 128K tokens
# ours is faster (B 1 128K 99.9 vs 104.0, B 128 1K 103.3 vs 138.8: the adapter's q concatenation, schedule and
# empty-row fix cost ~10 us a call). At H 16 ours is faster or within 3% of the adapter at every shape, so few heads
# keep ours
FLASHMLA_MIN_TOKENS = 256 * 1024
FLASHMLA_FP8_MIN_HEADS = 128  # FlashMLA's FP8 kernel over power-of-two scales: footnote (13) of the table below
HALF = (torch.float16, torch.bfloat16)


class Choice(NamedTuple):
    name: str  # flashmla | seesaw | wgmma | swapab | fp8_swapab | triton | flashinfer | torch
    reason: str


@functools.lru_cache(maxsize=4096)
def select_decode_kernel(H: int, R: int, P: int, page_size: int, sparse: bool, dtype: torch.dtype, capability,
                         n_query: int = 1, *, kernel: str = "auto", tma_layout: bool = True,
                         rows_aligned: bool = True, flashmla: bool = False, flashinfer: bool = False,
                         tokens: int = FLASHMLA_MIN_TOKENS, fp8_cache: bool = False, fp8_rows: bool = False,
                         token_rows: bool = False, tokens_form: bool = False, pow2_scales: bool = False) -> Choice:
    """The decode kernel for one call's shape class: Choice(name, reason).

    H heads (rows) per request, R latent and P rope width, `page_size` (1 for a sparse index list), `sparse`
    (mla::sparse_decode), dtype, `capability`: the CUDA device's (major, minor), "interpreter" (CPU tensors
    handed to the kernels: Triton's interpreter) or None (CPU tensors: the op's CPU impl), n_query query tokens
    per request. Facts of the call's tensors: `tma_layout` (caches view as [slots, width] with pages of whole
    64-token tiles, `_gluon.tma_layout`), `token_rows` (page size 1 viewing as [slots, width]: a token table's
    cache, `_gluon.token_rows`; `tokens_form`: swapab's TOKENS form may take such a call in auto,
    `tuning.swapab_tokens`: on by default, what `decode_kernel` passes; a fact here so this table stays cached),
    `rows_aligned` (16-byte aligned rows, `_gluon.rows_aligned`),
    `flashmla` (FlashMLA imports and takes the call: in place; FP8, kernels/flashmla_fp8.py), `flashinfer` (FlashInfer
    usable now: installed, R 512, not under CUDA-graph capture), `tokens`: the most tokens the call may read, batch x
    the block table's capacity (shapes only: the lengths live on the device), `fp8_cache`: the latent cache is FP8
    (mla_compile/fp8.py; `dtype` stays q's), `fp8_rows`: the swap-AB kernel can read its layout, the three views
    runs of TMA rows in pages of whole 64-token tiles (`decode_fp8_swapab.eligible`: its TMA form) or rows of 16-byte
    chunks at 16-byte aligned addresses at any page size (`decode_fp8_swapab.gather_eligible`: its GATHER form,
    e.g. the HF pass's page-size-1 token table), and that kernel is switched on (`decode_fp8_swapab.ENABLED`);
    `pow2_scales`: the FP8 cache's scales are powers of two (the tuning's promise, `Tuning.fp8_scale_fmt`).
    `kernel`: "auto" or the one asked for (mla_compile/tuning.py); one that cannot serve the call falls back to
    auto's choice, saying why.

    auto, first match (H200 measurements: issue 24's table and benchmarks/RESULTS.md, ops table and the seesaw /
    Gluon kernel sections; every kernel timed as a CUDA-graph replay):

    | shape class (first match)                                          | kernel   | why |
    |--------------------------------------------------------------------|----------|-----|
    | CPU tensors at the op                                              | torch    | the op's CPU impl (definition) |
    | FP8 cache of power-of-two scales (13), FlashMLA FP8 takes it, H 128 | flashmla | 1.45-1.52x ours (13) |
    | FP8 cache, sm_90, bf16 q, R 512 / P 64, 1 query token, dense,      | fp8_swapab | 2x Triton's FP8 (9) |
    |   views it reads: TMA tiles or 16-byte aligned rows (fp8_rows)     |          |     |
    | FP8 cache otherwise                                                | triton   | the only other FP8 reader (10) |
    | FlashMLA in place (1), sm_90, dense, 1 query token, H >= 64,       | flashmla | faster than ours there (2) |
    |   tokens >= FLASHMLA_MIN_TOKENS (256K)                             |          |     |
    | sm_90, fp16/bf16, Gluon rows (7), TMA layout (3), P 64 (8)         | seesaw   | 1-6% faster than wgmma (4) |
    | sm_90, fp16/bf16, Gluon rows (7), other layouts (5), P > 0         | wgmma    | 1.5-1.6x Triton TMA at H 128 |
    | sm_90, fp16/bf16, H < 64, 1 query token, TMA layout (3) or token | swapab   | 0.90-1.04 of copy bw (11) |
    |   rows (12), R 512 / P 64                                          |          |     |
    | the rest: H < 64, not sm_90, fp32, P = 0, rows < 32                | triton   | memory-bound few heads (6) |

    (1) FlashMLA installed, R 512, P 64 or 0, page 64, fp16/bf16, ckv and kpe the two column ranges of one
        [NP, PS, R + P] buffer (kernels/flashmla.fused_caches); over two separate caches it would copy them every
        call (more bytes than the attention reads).
    (2) H 128: ours takes 1.06-1.31x the adapter's time from 256K tokens (batch x kv) up and is faster at 128K and
        below; H 16: ours faster or within 3% everywhere (H200 2026-12-02); FlashInfer 1.04-1.17x FlashMLA.
    (3) pages of whole 64-token tiles viewing as [slots, width]; R/2 a power of two <= 256.
    (4) the warp-specialised kernel: B=8 128K stage 1 669 vs 708 us, 429 TFLOP/s.
    (5) page sizes under 64 or sparse index lists (16-byte aligned rows, R/2 and P >= 64), or P != 64.
    (6) split-KV Triton kernels at 0.79-0.92 of copy bandwidth; the kernel for P = 0 (a zero rope column) and for
        several query tokens of few rows.
    (7) H >= 64 with one query token; with n_query > 1 (paged), H is the rows (n_query x heads) and from 32 of them
        the Gluon kernels take the call, each row with its own causal limit: MULTI_TOKEN_GLUON_ROWS says why.
    (8) several query tokens in one head block (<= 64 rows): wgmma, 12-16% faster there (MULTI_TOKEN_GLUON_ROWS).
    (9) the Gluon kernel with the 64 tokens as the warpgroup MMA's M (kernels/decode_fp8_swapab.py) unless switched
        off (`fp8_rows` is false while `decode_fp8_swapab.ENABLED` is off, MLA_COMPILE_FP8_SWAPAB=0); pages of
        whole 64-token tiles take its TMA form, other page sizes (a token table) its GATHER form (cp.async row
        copies through the table: 102.7 vs 85.3 us for the TMA form, H100 H 16 B 8 32K), a token table its TOKENS
        form at 16 heads (runs of rows as TMA boxes; its `stage1_plan` picks the form, tuning.swapab_tokens). H200
        2026-12-05: H 16 B 8 32K 82.7 us against 171.2 for the Triton FP8 kernel and 89.8 for our bf16 cache; H 64
        151.5 vs 450.4.
    (10) kernels/decode_fp8.py (scales folded into fp16 MMAs; fp32 q: the pointer kernel dequantizing its tiles);
        FlashMLA's V3.2 FP8 kernel (H 64 / 128) serves "flashmla" asked for, never auto (bf16 numerics).
    (11) kernels/decode_swapab.py: TMA tiles fed to warpgroup MMAs with the 64 tokens as M, the heads as N (no row
        padded). H100 2026-12-05, graph replay, H 16: B 8 8K 36.1 us vs 43.1 for the Triton kernel and 37.5 for
        FlashInfer; B 1 32K 17.2 vs 29.9 (FlashInfer 43.4); B 8 32K 108.3 vs 115.1 (110.4); H 32 B 8 32K 112.3
        vs 148.8 (111.3). Index lists keep the Triton kernels.
    (12) a page-size-1 cache under a token table (the HF pass's): swapab's TOKENS form checks each tile's 64
        entries on the device; consecutive rows (a request's tokens in a static cache) are TMA boxes, other tiles
        16-byte cp.async row copies. Auto's with `tokens_form` (decode_swapab.TOKENS_IN_AUTO: on, the HF step
        H 16 B 8 32K 820.7 vs 870.2 us with the Triton kernel; MLA_COMPILE_SWAPAB_TOKENS=0 takes it out).
    (13) `pow2_scales`: FlashMLA's V3.2 FP8 kernel is exact for them; H 64 / 8K within 3% of ours (Tuning's docs).

    FlashInfer is never auto's: at H 128 it is faster than ours but slower than FlashMLA, and its cached
    workspace broke torch.compile's cudagraph-tree pool check (H200 2026-11-30); asked for, it serves eager calls.

    Cheap: cached on its (hashable) arguments, no device query.
    """
    if kernel not in _tuning.DECODE_KERNELS:
        raise ValueError(f"kernel: expected one of {', '.join(_tuning.DECODE_KERNELS)}, got {kernel!r}")
    one_dense = n_query == 1 and not sparse
    sm90 = capability == (9, 0)
    gluon_shapes = sm90 and dtype in HALF and P > 0 and _wgmma.fits(R, P)
    gluon = gluon_shapes and (H >= MANY_HEADS if n_query == 1 else H >= MULTI_TOKEN_GLUON_ROWS and not sparse)
    cannot = {  # kernel -> why it cannot serve this call ("": it can)
        "flashmla": "" if flashmla and one_dense and sm90 else
                    "FlashMLA: needs flash_mla on sm_90, one query token, a paged cache it reads in place",
        "flashinfer": "" if flashinfer and one_dense and P > 0 else
                      "FlashInfer: needs it installed, R 512, P > 0, one query token, no CUDA-graph capture",
        "seesaw": "" if gluon and tma_layout and _seesaw.fits(R, P) else
                  "seesaw: needs sm_90, fp16/bf16, >= 64 heads (several query tokens: >= 32 rows), pages of whole "
                  "64-token tiles, P 64",
        "wgmma": "" if gluon and (tma_layout or (rows_aligned and _wgmma.gather_fits(R, P))) else
                 "wgmma: needs sm_90, fp16/bf16, >= 64 heads (several query tokens: >= 32 rows), power-of-two R/2 "
                 "and P, aligned rows",
        "swapab": "" if sm90 and dtype in HALF and one_dense and (tma_layout or token_rows) and _swapab.fits(R, P)
                  else "swapab: needs sm_90, fp16/bf16, R 512 / P 64, one query token, pages of whole 64-token "
                       "tiles or a token table (page size 1) over caches viewing as [slots, width]",
        "triton": "",
    }
    if capability is None:
        return Choice("torch", "CPU tensors: the op's CPU impl (the plain-torch definition)")
    if fp8_cache:
        return _select_fp8_kernel(kernel, sm90 and one_dense and fp8_rows and _fp8_swapab.fits(R, P, dtype),
                                  flashmla and sm90 and n_query == 1, pow2_scales and H >= FLASHMLA_FP8_MIN_HEADS)
    facts = dict(tma_layout=tma_layout, rows_aligned=rows_aligned, flashmla=flashmla, flashinfer=flashinfer,
                 tokens=tokens, token_rows=token_rows, tokens_form=tokens_form)
    if kernel == "fp8_swapab":
        auto = select_decode_kernel(H, R, P, page_size, sparse, dtype, capability, n_query, **facts)
        return Choice(auto.name, f"asked for fp8_swapab, which cannot serve this call (it reads FP8 caches only); "
                                 f"auto: {auto.reason}")
    if kernel != "auto":
        if not cannot[kernel]:
            return Choice(kernel, "asked for")
        auto = select_decode_kernel(H, R, P, page_size, sparse, dtype, capability, n_query, **facts)
        return Choice(auto.name, f"asked for {kernel}, which cannot serve this call ({cannot[kernel]}); auto: "
                                 f"{auto.reason}")
    if not cannot["flashmla"] and H >= MANY_HEADS and tokens >= FLASHMLA_MIN_TOKENS:
        return Choice("flashmla", "FlashMLA: faster than ours at many heads and >= 256K tokens per call (H200)")
    if not cannot["seesaw"] and (n_query == 1 or H > MANY_HEADS):
        return Choice("seesaw", ("several query tokens in more than one head block" if n_query > 1 else "many heads")
                      + " on sm_90, TMA layout, rope 64: the warp-specialised Gluon kernel")
    if not cannot["wgmma"]:
        return Choice("wgmma", ("several query tokens, a limit per row" if n_query > 1 else "many heads")
                      + " on sm_90: the Gluon warpgroup-MMA kernel ("
                      + ("TMA boxes" if tma_layout and not sparse else "16-byte row copies") + ")")
    if not cannot["swapab"] and H < MANY_HEADS and (tma_layout or tokens_form):
        return Choice("swapab", f"few heads on sm_90, {'TMA layout' if tma_layout else 'a token table'}: the swap-AB "
                                "Gluon kernel (the tokens as the MMA's M)")
    why = ("rope-less (P = 0): a zero rope column" if P == 0
           else "several query tokens of few rows" if n_query > 1 and H < MULTI_TOKEN_GLUON_ROWS
           else f"few heads ({cannot['swapab'] or 'a token table: the TOKENS form off, MLA_COMPILE_SWAPAB_TOKENS'})"
           if H < MANY_HEADS and n_query == 1 and sm90
           else "few heads" if H < MANY_HEADS and n_query == 1 else "not an sm_90 GPU" if not sm90 else
           "not fp16/bf16" if dtype not in HALF else "a shape or layout the Gluon kernels do not take")
    return Choice("triton", f"{why}: the Triton split-KV kernels")


FP8_SWAPAB_CANNOT = ("fp8_swapab: needs sm_90, Gluon, bf16 q, R 512 / P 64, one query token, a dense (paged) call, "
                     "the three views TMA rows in pages of whole 64-token tiles or 16-byte aligned rows, and the "
                     "kernel not switched off (decode_fp8_swapab.ENABLED, MLA_COMPILE_FP8_SWAPAB=0)")
FLASHMLA_FP8_CANNOT = ("FlashMLA's FP8 kernel: needs flash_mla on sm_90, bf16 q, 64 or 128 heads, R 512 / P 64, one "
                       "query token, the three views of one [pages, page_size, 656] buffer (kernels/flashmla_fp8.py)")
FP8_REASON = ("an FP8 latent cache: the Triton FP8 kernels (bf16 / fp16 q: scales folded into the products, "
              "decode_fp8.py; fp32 q: the pointer kernel dequantizing its tiles in registers) (FlashInfer and "
              "the bf16 Gluon kernels take fp16/bf16 caches only; FlashMLA's FP8 kernel is asked-for only)")


def _select_fp8_kernel(kernel: str, swapab: bool, flashmla: bool = False, pow2_many_heads: bool = False) -> Choice:
    """`select_decode_kernel` for an FP8 cache: FlashMLA's V3.2 FP8 kernel (`flashmla`: it serves the call) asked
    for, or auto's at 128 heads over power-of-two scales; else the swap-AB Gluon kernel where it serves, else
    Triton's."""
    if kernel == "flashmla" and flashmla:
        return Choice("flashmla", "asked for: FlashMLA's V3.2 FP8 kernel (bf16 dequantization)")
    if kernel == "auto" and flashmla and pow2_many_heads:
        return Choice("flashmla", "power-of-two scales (Tuning.fp8_scale_fmt), 128 heads: FlashMLA's V3.2 FP8 "
                                  "kernel, exact for them and faster than ours there")
    auto = (Choice("fp8_swapab", "an FP8 cache on sm_90 in a layout it reads (TMA tiles or 16-byte aligned rows): "
                                 "the swap-AB Gluon kernel (the tokens as the warpgroup MMA's M)") if swapab
            else Choice("triton", FP8_REASON + ("" if kernel in ("auto", "triton") else f" ({FP8_SWAPAB_CANNOT})")))
    if kernel == "auto" or kernel == auto.name:
        return auto if kernel == "auto" else Choice(kernel, "asked for")
    if kernel == "triton":
        return Choice("triton", "asked for")
    why = (FP8_SWAPAB_CANNOT if kernel == "fp8_swapab" else FLASHMLA_FP8_CANNOT if kernel == "flashmla"
           else f"an FP8 cache: {kernel} reads fp16/bf16 caches only")
    return Choice(auto.name, f"asked for {kernel}, which cannot serve this call ({why}); auto: {auto.reason}")


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device):
    """What `select_decode_kernel` takes as `capability`: (major, minor) of a CUDA device; CPU tensors reaching
    these CUDA impls are a direct call for the Triton kernels (they run under TRITON_INTERPRET=1)."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else "interpreter"


def _facts(q_nope, q_pe, ckv_cache, kpe_cache, sparse: bool, n_query: int, block_table=None) -> tuple[tuple, dict]:
    """`select_decode_kernel`'s shape-class arguments and layout facts for these tensors; `tokens` from the block
    table's capacity (without one: the whole cache)."""
    cap = _capability(q_nope.device)
    H = q_nope.shape[1]
    # the layout facts matter (and are computed) only where a Gluon kernel may run: one query token (few heads: the
    # swap-AB kernel), or several in >= 32 rows
    gluon_device = cap == (9, 0) and (n_query == 1 or H >= MULTI_TOKEN_GLUON_ROWS)
    tma = gluon_device and _gluon.tma_layout(ckv_cache, kpe_cache, sparse)
    token_rows = gluon_device and _gluon.token_rows(ckv_cache, kpe_cache, sparse)
    tokens = (q_nope.shape[0] * block_table.shape[1] if block_table is not None else ckv_cache.shape[0]) \
        * ckv_cache.shape[1]
    return ((H, q_nope.shape[2], q_pe.shape[-1], 1 if sparse else ckv_cache.shape[1], sparse, q_nope.dtype, cap,
             n_query),
            # TMA boxes are 16-byte aligned rows too: the row check only where the gather kernel would copy them
            dict(tma_layout=tma, rows_aligned=tma or (gluon_device and _gluon.rows_aligned(ckv_cache, kpe_cache)),
                 tokens=tokens, token_rows=token_rows,
                 tokens_form=token_rows and _tuning.swapab_tokens(_swapab.TOKENS_IN_AUTO)))


def decode_kernel(q_nope, q_pe, ckv_cache, kpe_cache, sparse: bool = False, n_query: int = 1,
                  kernel: str | None = None, block_table=None, ckv_scale=None) -> Choice:
    """The kernel `decode` / `sparse_decode` run for these tensors: `select_decode_kernel` on the call's facts.
    `kernel`: the one asked for (default: the tuning in effect, mla_compile/tuning.py); `block_table`: the call's
    (its capacity bounds the tokens read; without it the whole cache does); `ckv_scale`: an FP8 ckv_cache's scales
    (mla_compile/fp8.py), whose layout decides whether the FP8 Gluon kernel can read it."""
    kernel = _tuning.decode_kernel() if kernel is None else kernel
    args, facts = _facts(q_nope, q_pe, ckv_cache, kpe_cache, sparse, n_query, block_table)
    sm90, page_size = args[6] == (9, 0), args[3]
    if fp8.is_fp8(ckv_cache):
        pow2 = _tuning.current().fp8_scale_fmt == fp8.UE8M0
        wanted = kernel == "flashmla" or (kernel == "auto" and pow2 and args[0] >= FLASHMLA_FP8_MIN_HEADS)
        return select_decode_kernel(*args, kernel=kernel, **facts, fp8_cache=True, pow2_scales=pow2,
                                    flashmla=wanted and _fm8.supported(q_nope, q_pe, ckv_cache, kpe_cache,
                                                                       ckv_scale)[0],
                                    fp8_rows=(sm90 and _fp8_swapab.ENABLED
                                              and (_fp8_swapab.eligible(ckv_cache, kpe_cache, ckv_scale)
                                                   or _fp8_swapab.gather_eligible(ckv_cache, kpe_cache, ckv_scale))))
    return select_decode_kernel(
        *args, kernel=kernel, **facts,
        # (auto asks FlashMLA only where it may win: many heads; the in-place test reads storage pointers)
        flashmla=((kernel == "flashmla" or (kernel == "auto" and args[0] >= MANY_HEADS)) and sm90 and not sparse
                  and _fmla.in_place(q_nope, ckv_cache, kpe_cache, page_size)),
        flashinfer=kernel == "flashinfer" and not sparse and _fi.usable(q_nope, ckv_cache))


def own_decode_config(q_nope, q_pe, ckv_cache, kpe_cache, sparse: bool = False) -> _decode.DecodeConfig:
    """The DecodeConfig of the kernel of ours that `auto` runs for these tensors where FlashMLA is absent (what a
    benchmark times as "ours")."""
    args, facts = _facts(q_nope, q_pe, ckv_cache, kpe_cache, sparse, 1)
    return _config(q_nope, ckv_cache, sparse, select_decode_kernel(*args, **facts).name)


def _config(q_nope, ckv_cache, sparse: bool, name: str) -> _decode.DecodeConfig:
    """decode.py's config for the chosen kernel (tiling, split policy, stage-1 kernel): the many-head Gluon kernels
    the 64-row split policy whatever the rows, the swap-AB ones their own head blocks; one program per SM."""
    if name in ("swapab", "fp8_swapab"):
        kernel = _swapab if name == "swapab" else _fp8_swapab
        t = kernel.default_tiling(q_nope.shape[1])
        return _decode.DecodeConfig(block_h=t.N, block_n=kernel.BLOCK_T, num_warps=t.warps, num_stages=t.stages,
                                    ctas_per_sm=1, max_splits=256, kernel=name)
    rows = q_nope.shape[1] if name == "triton" else max(q_nope.shape[1], MANY_HEADS)
    cfg = _decode.default_config(rows, q_nope.shape[2], 1 if sparse else ckv_cache.shape[1], q_nope.dtype)
    return cfg if name == "triton" else dataclasses.replace(cfg, kernel=name)


def unfolded(plan, outer: tuple, first_limit: bool = False):
    """A plan over rows ([B, S*H, *] q, out / lse) as one taking q [B, S, H, *] (`outer`) and giving out [B, S, H, R]
    / lse [B, S, H]: views (or, where q's strides allow none, copies) each call. `first_limit`: one query token with a
    [B, 1] limits table, handed over as its column."""
    B, S, H, R = outer
    rows, lse_shape = (B, S * H), outer[:-1]

    def run(qn, qp, ckv, kpe, table, lens, scale=None):
        out, lse = plan(qn.reshape(*rows, R), qp.reshape(*rows, qp.shape[-1]), ckv, kpe, table,
                        lens[:, 0] if first_limit else lens, scale)
        return out.view(outer), lse.view(lse_shape)

    return run


def decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, n_query=1, ckv_scale=None,
                outer=None):
    """(plan, keep): `plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, ckv_scale)` decodes any call of
    these tensors' signature (shapes, strides, dtypes, device, alignment, sm_scale, n_query, the tuning and
    environment in effect) with the kernel chosen now; `keep`: whether the choice holds for every such call (not
    FlashInfer's, which depends on whether a CUDA graph is being captured). Our kernels' plan is kernels/decode.py's
    `AttendPlan`'s `run` (the op's argument order: no adapter on the hot path).

    n_query = S > 1: S query tokens per request folded into q's rows ([B, S*H, *], see kernels/decode.py
    `decode`): the Gluon TMA / gather kernel or the Triton pointer kernel, by rows (`select_decode_kernel`;
    FlashMLA, FlashInfer and the seesaw kernel take one token per request).
    An FP8 cache (ckv_scale given, mla_compile/fp8.py): the FP8 Gluon kernel or the Triton ones (`decode_kernel`).
    `outer`: q's own shape [B, S, H, R] where q_nope / q_pe are row-folded VIEWS of it (ops/attention.py); the plan
    then takes q and gives out / lse in that shape: free for our kernels' plans (kernels/decode.py `decode_plan`:
    they read q by pointer and the strides fixed here), views each call for the peers' (`unfolded`)."""
    name = decode_kernel(q_nope, q_pe, ckv_cache, kpe_cache, n_query=n_query, block_table=block_table,
                         ckv_scale=ckv_scale).name
    if name == "flashmla" and ckv_scale is not None:  # asked for: FlashMLA's FP8 kernel (kernels/flashmla_fp8.py)
        def fm8(qn, qp, ckv, kpe, table, lens, scale):
            return _fm8.run_decode(qn, qp, ckv, table, lens, sm_scale)

        return (fm8 if outer is None else unfolded(fm8, outer)), True
    if name in ("flashmla", "flashinfer"):  # FlashInfer's plan depends on whether a graph is being captured: not kept
        peer = _fmla.decode if name == "flashmla" else _fi.decode

        def plan(qn, qp, ckv, kpe, table, lens, scale):
            return peer(qn, qp, ckv, kpe, table, lens, sm_scale)

        return (plan if outer is None else unfolded(plan, outer)), name == "flashmla"
    if name in ("seesaw", "wgmma", "swapab", "fp8_swapab"):  # the Gluon kernels (the swap-AB ones: one query token)
        return _decode.decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                   cfg=_config(q_nope, ckv_cache, False, name), n_query=n_query,
                                   ckv_scale=ckv_scale, outer=outer).run, True
    _planned(name, "decode_plan")
    # the Triton kernels; a rope-less call (see above) with a zero rope column
    zero = rope_less(q_pe)
    q_pe, kpe_cache = with_zero_rope(q_nope, ckv_cache) if zero else (q_pe, kpe_cache)
    return zero_rope_run(_decode.decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale,
                                              n_query=n_query, ckv_scale=ckv_scale, outer=outer).run, zero), True


def _planned(name: str, where: str) -> None:
    """A plan function's last branch takes the Triton kernels only: any other choice reaching it is a kernel that
    branch would silently replace (a "swapab" choice once ran the Triton kernels this way): an error, not a fallback."""
    if name != "triton":
        raise RuntimeError(f"dispatch.{where}: no plan for the kernel {name!r} select_decode_kernel chose")


def decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, n_query=1, ckv_scale=None):
    """One call: `decode_plan`'s plan, made and run (the op's impl keeps plans per signature, ops/_plans.py)."""
    plan, _ = decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, sm_scale, n_query, ckv_scale)
    return plan(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, ckv_scale)


def sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale=None, outer=None):
    """(plan, keep) as `decode_plan`: `plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, None, ckv_scale)` (the
    lengths' place empty: an index list bounds itself). An FP8 cache (ckv_scale given): the Triton pointer kernel
    (`decode_kernel`). `outer`: q's own shape [B, S, H, R] where q_nope / q_pe / indices are views of [B, S, ...]
    folded to B*S requests; the plan then takes them unfolded and gives out / lse in q's shape."""
    name = decode_kernel(q_nope, q_pe, ckv_cache, kpe_cache, sparse=True, ckv_scale=ckv_scale).name
    if name == "flashmla":  # an FP8 cache, asked for: FlashMLA's V3.2 kernel (q / indices [B, S, ...] as they are)
        return (lambda qn, qp, ckv, kpe, idx, lens, scale: _fm8.run_sparse(qn, qp, ckv, idx, sm_scale)), True
    if name == "wgmma":
        return _decode.sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale,
                                          cfg=_config(q_nope, ckv_cache, True, "wgmma"), outer=outer).run, True
    _planned(name, "sparse_decode_plan")
    zero = rope_less(q_pe)
    q_pe, kpe_cache = with_zero_rope(q_nope, ckv_cache) if zero else (q_pe, kpe_cache)
    return zero_rope_run(_decode.sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale,
                                                     ckv_scale=ckv_scale, outer=outer).run, zero), True


def sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale=None):
    plan, _ = sparse_decode_plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, sm_scale, ckv_scale)
    return plan(q_nope, q_pe, ckv_cache, kpe_cache, indices, None, ckv_scale)


def merge_states_plan(outs, lses):
    return _merge.merge_states_plan(outs, lses), True


def cache_write_plan(ckv_cache, kpe_cache, ckv, kpe, slots):
    """(plan, keep): `plan(ckv_cache, kpe_cache, ckv, kpe, slots)` for a cache in q's dtype (not FP8)."""
    if rope_less(kpe):
        return (lambda *tensors: cache_write(*tensors)), True
    return _cache.cache_write_plan(ckv_cache, kpe_cache, ckv, kpe, slots), True


def cache_write_fp8_plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt=None):
    """(plan, keep): `plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots)` for an FP8 cache (quantized on write)."""
    if rope_less(kpe):
        return (lambda c, k, s, ckv, kpe, slots: cache_write(c, k, ckv, kpe, slots, s, scale_fmt)), True
    return _cache.cache_write_fp8_plan(ckv_cache, kpe_cache, ckv_scale, ckv, kpe, slots, scale_fmt), True


def cache_write_fp8_tokens_plan(token_buf, ckv, kpe, slots, scale_fmt=None):
    """(plan, keep): `plan(token_buf, ckv, kpe, slots)` for an FP8 token buffer (kernels/cache.py: one launch writing
    into the buffer itself); a rope-less call through the buffer's views (`cache_write_fp8_plan`'s zero column)."""
    if rope_less(kpe):
        R = ckv.shape[1]

        def through_views(token_buf, ckv, kpe, slots):
            c, s, k = fp8.views(token_buf, R, kpe.dtype)
            cache_write(c, k, ckv, kpe, slots, s, scale_fmt)

        return through_views, True
    return _cache.cache_write_fp8_tokens_plan(token_buf, ckv, kpe, slots, scale_fmt), True


def cache_write(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale=None, scale_fmt=None):
    """ckv_scale given: an FP8 cache, ckv quantized on the way in (kernels/cache.py)."""
    if rope_less(kpe):
        # P = 0: nothing to write for the rope part; the kernel (which always writes both) copies a zero element
        # onto itself instead of touching a zero-width (possibly null) buffer
        zero = kpe_cache.new_zeros(1)
        kpe_cache, kpe = zero_rope_column(zero, *ckv_cache.shape[:2]), zero_rope_column(zero, ckv.shape[0])
    if ckv_scale is None:  # the bf16 call as it always was
        _cache.cache_write(ckv_cache, kpe_cache, ckv, kpe, slots)
    else:
        _cache.cache_write(ckv_cache, kpe_cache, ckv, kpe, slots, ckv_scale, scale_fmt)


def indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale):
    return _dsa.indexer_topk(q, weights, k_cache, block_table, seq_lens, topk, sm_scale)


def indexer_topk_plan(q, weights, k_cache, block_table, seq_lens, topk, sm_scale, n_query=1, out_shape=None):
    """(plan, keep): `plan(q, weights, k_cache, block_table, seq_lens)` -> `dsa::indexer_topk` for q [B, Hi, Di] of
    this signature (kernels/dsa.py: the keys kernel, then the radix select or torch.topk and the slots kernel);
    n_query = S query tokens per request as B*S rows of q (kernels/dsa.py `indexer_topk_plan`)."""
    return _dsa.indexer_topk_plan(q, weights, k_cache, block_table, seq_lens, topk, sm_scale, n_query=n_query,
                                  out_shape=out_shape), True


def dcp_local_candidates_plan(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size, dcp_rank):
    """(plan, keep): `plan(q, weights, k_cache, block_table, local_lens)` -> `dsa::dcp_local_candidates` for inputs of
    this signature (kernels/dsa.py: the keys kernel with the global index, then the radix select or torch.topk)."""
    return _dsa.candidate_keys_plan(q, weights, k_cache, block_table, local_lens, topk, sm_scale, dcp_size,
                                    dcp_rank), True


def k_only_indices(block_table, seq_lens, page_size, topk):
    return _dsa.k_only_indices(block_table, seq_lens, page_size, topk)


def k_only_indices_plan(block_table, seq_lens, page_size, topk, n_query=1):
    """(plan, keep): `plan(block_table, seq_lens)` -> `k_only_indices(...)` for inputs of this signature (n_query > 1:
    int32 [B, n_query, topk])."""
    shape = (block_table.shape[0], n_query, topk) if n_query > 1 else None
    return _dsa.k_only_plan(block_table, seq_lens, page_size, topk, n_query, shape), True


def fused_linear_plan(x, weights):
    return _linear.fused_plan(x, weights), True


def linear_partials_plan(x, weights, splits):
    return _linear.linear_partials_plan(x, weights, splits), True


def per_head_linear_plan(x, weight):
    return _linear.per_head_plan(x, weight), True


