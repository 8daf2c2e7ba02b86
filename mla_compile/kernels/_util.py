"""Small helpers shared by the Triton kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ..tuning import PDL_ENV


# Host-side integer helpers. Triton 3.6's triton.cdiv / triton.next_power_of_2 are constexpr functions: a host call
# goes through their argument unwrapping, ~5 us each on one CPU core, and a decode call made nine of them
# (benchmarks/host_overhead.py). Same results (next_power_of_2(0) is 0, as Triton's).
def cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 0 else 0


def block(n: int) -> int:
    """Power-of-two tile side covering n, at least 16 (tl.dot needs >= 16 on every side)."""
    return max(16, next_power_of_2(max(n, 1)))


def query_limit_args(seq_lens, n_query: int, rows: int) -> tuple:
    """The stage-1 kernels' row-limit arguments for `rows` = n_query * heads rows per request (row j * heads + h is
    head h of query token j): (n_query, heads, s_lenb, s_lenq, causal). Row j sees tokens t < Lens[b * s_lenb +
    j * s_lenq] + causal * (j - n_query + 1): seq_lens [B] is one causal length per request (causal 1, s_lenq 0),
    [B, n_query] each query token's own limit (causal 0: DCP's per-rank counts)."""
    multi = n_query > 1
    causal = int(not multi or seq_lens.dim() == 1)
    return (n_query, rows // n_query, seq_lens.stride(0) if multi else 1,
            seq_lens.stride(1) if multi and not causal else 0, causal)


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs: small numbers keep split-KV and merge paths exercised
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def has_tma(device: torch.device) -> bool:
    """TMA descriptors need sm_90+ (Hopper); the interpreter (CPU tensors) emulates them."""
    if device.type != "cuda":
        return True
    return torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def is_sm90(device: torch.device) -> bool:
    """Hopper exactly: warpgroup MMA (the Gluon kernels) exists on sm_90 only."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def box_width(x: int) -> bool:
    """A width a TMA box side and an MMA operand both take: a power of two in [16, 256]."""
    return 16 <= x <= 256 and x & (x - 1) == 0


def slot_stride(cache) -> int:
    """Elements between consecutive slots (token rows) of a paged cache [pages, page_size, width]."""
    return cache.stride(1) if cache.shape[1] > 1 else cache.stride(0)


def caches_view_as_slots(ckv_cache, kpe_cache) -> bool:
    """Paged caches [pages, page_size, width] whose slots are rows at one stride, pages back to back (a TMA
    descriptor over the whole cache as [slots, width], `slot_stride` apart), the stride a multiple of 16 bytes,
    16-byte aligned, unit inner stride. Packed caches are; so are the two column ranges of one [NP, PS, R + P]
    buffer (FlashMLA's K layout, `flashmla.fused_caches`; vLLM's and SGLang's MLA caches are one such buffer)."""
    return tma_rows(ckv_cache) and tma_rows(kpe_cache)


def tma_rows(cache) -> bool:
    """One paged cache [pages, page_size, width] whose slots are TMA rows (`caches_view_as_slots`' rule)."""
    rs = slot_stride(cache)
    return (cache.stride(2) == 1 and rs >= cache.shape[2] and (rs * cache.element_size()) % 16 == 0
            and (cache.shape[1] == 1 or cache.shape[0] == 1 or cache.stride(0) == cache.shape[1] * rs)
            and cache.data_ptr() % 16 == 0)


# programmatic dependent launch for our kernels: "auto" (default) / "1" on sm_90+, "0" never. HF DeepSeek-V3 step
# (H 16, batch 8, 32K, H200): 736 -> 725 us, 716 with Inductor's kernels too (benchmarks/RESULTS.md). The switch's
# name lives with the others in mla_compile/tuning.py


@functools.lru_cache(maxsize=None)
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


_PDL_ON = {"PDL": True, "launch_pdl": True}


def pdl_launch(device: torch.device) -> dict:
    """Launch arguments for programmatic dependent launch (Hopper+), {} where it is off. With it, a kernel's
    programs may be scheduled while the kernel before it on the stream drains (its launch latency and the
    predecessor's tail overlap: the ~0.5 us idle gaps between the kernels of a CUDA graph); the kernel must start
    with `pdl_enter`. CUDA graphs capture it as a programmatic edge. The environment is read per call (tests
    switch it); the returned dict is shared: unpack it, never change it."""
    if not _pdl_capable(device) or os.environ.get(PDL_ENV, "auto") not in ("auto", "1"):
        return {}
    return _PDL_ON


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """First statement of every kernel launched with `pdl_launch`: wait until the previous kernel on the stream
    has completed and its writes are visible (before ANY memory access: reads of its outputs, and writes to memory
    it may still read), then let the next kernel launch. Releasing dependents only after the wait keeps the
    ordering transitive for kernels that skip the wait (Inductor emits one only when it reads its predecessor's
    outputs). A no-op when PDL is off."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # Triton reads it once too, when it is imported


def patch_interpreter_for_numpy2() -> None:
    """Triton 3.6's interpreter turns a scalar (stored as a 1-element array) into a loop bound with int(array),
    which NumPy 2 rejects for 1-d arrays: every kernel with `range(start, end)` over runtime bounds (the decode
    kernels' token loops) then fails on a CPU. Scalars index through .item() instead. Applied once, when this module
    is imported under TRITON_INTERPRET=1 (our kernels' CPU runs: tests, lab probes, a laptop's interpreter run)."""
    import triton.runtime.interpreter as interp

    orig = getattr(interp, "_patch_lang_tensor", None)
    if orig is None or getattr(orig, "_mla_numpy2", False):  # another Triton, or patched already
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._mla_numpy2 = True
    interp._patch_lang_tensor = patched


if _INTERPRETED:
    patch_interpreter_for_numpy2()


@functools.lru_cache(maxsize=None)
def dot_mode(dtype: torch.dtype) -> dict:
    """Constexprs for `mma`: fp32 inputs use exact (ieee) products rather than tf32. Triton 3.6's CPU
    interpreter computes bf16 tl.dot wrongly (it multiplies the raw bits), so under TRITON_INTERPRET=1
    bf16 operands are upcast to fp32 first; GPU code is unaffected. Cached (a shared dict: unpack it)."""
    upcast = dtype == torch.bfloat16 and _INTERPRETED
    return dict(DOT_PREC="ieee" if dtype == torch.float32 else "tf32", DOT_UPCAST=upcast)


@triton.jit
def mma(a, b, acc, DOT_PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """acc + a @ b with fp32 accumulation."""
    if DOT_UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=DOT_PREC)
