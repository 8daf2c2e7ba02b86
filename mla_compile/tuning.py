"""The one configuration surface for run-time choices: a frozen `Tuning`, its fields documented, defaults = the
measured choices.

How a Tuning reaches the code that reads it:
- `torch.compile(m, backend="mla_dcp", options={"decode_kernel": "triton", ...})`: the backend takes the Tuning
  keys out of `options` (`from_options`) and runs the compile and every call of the compiled graph under it
  (`use`, `bind`);
- eager code, benchmarks and tests: `with tuning.use(Tuning(decode_kernel="wgmma")): ...`;
- readers call `current()` (the innermost `use`, else the defaults) once per op call: a context-variable read.

Environment variables are kept only where a process-wide switch is the point (an operator's or a debugging
switch, read at each call so a test may set it):
- MLA_COMPILE_DECODE_BACKEND = auto | flashmla | seesaw | wgmma | swapab | fp8_swapab | triton | flashinfer: the
  decode kernel wherever `Tuning.decode_kernel` is left at "auto" (`decode_kernel()`);
- MLA_COMPILE_PDL = auto | 1 | 0: programmatic dependent launch of our kernels (kernels/_util.py);
- MLA_COMPILE_SWAPAB_TOKENS = auto | 1 | 0: the swap-AB kernels' TOKENS form over page-size-1 token tables (the HF
  pass's caches) on or off; auto (or unset): each kernel's measured default (`swapab_tokens()`);
- MLA_COMPILE_CHECK_DATA = 1: value checks (host syncs) on CUDA too (ops/_checks.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
from collections.abc import Mapping
from typing import Any

DECODE_KERNEL_ENV = "MLA_COMPILE_DECODE_BACKEND"
PDL_ENV = "MLA_COMPILE_PDL"  # read by kernels/_util.pdl_launch
GLUON_PDL_ENV = "MLA_COMPILE_GLUON_PDL"  # read by kernels/_gluon.pdl_launch (as PDL_ENV: "auto" / "1" on)
SWAPAB_TOKENS_ENV = "MLA_COMPILE_SWAPAB_TOKENS"  # read by swapab_tokens() when a plan is made
# what `mla::decode` / `mla::sparse_decode` may run on CUDA (kernels/dispatch.select_decode_kernel has the table)
DECODE_KERNELS = ("auto", "flashmla", "seesaw", "wgmma", "swapab", "fp8_swapab", "triton", "flashinfer")
ABSORB = ("auto", "per_head_linear", "bmm")  # how the attention pass writes the absorbed W_UK / W_UV products


@dataclasses.dataclass(frozen=True)
class Tuning:
    """Run-time choices; the defaults are what the measurements chose (benchmarks/RESULTS.md).

    decode_kernel: the CUDA decode kernel, one of DECODE_KERNELS. "auto" (default): the fastest measured for the
        call's shape class (kernels/dispatch.select_decode_kernel), or MLA_COMPILE_DECODE_BACKEND where that is
        set. Any other value asks for that kernel; a call it cannot serve (shape, device, layout, or FlashInfer
        under CUDA-graph capture) falls back to auto's choice, with the reason in `dispatch.decode_kernel`'s
        answer. Read per op call.

    The graph rewrites read these while they compile (a change means a new compile, not a changed graph):

    absorb: how passes/mla_attention.py writes the absorbed projections (q_nope @ W_UK, attn @ W_UV), one of ABSORB.
        "auto": `mla.per_head_linear` (one few-token Triton launch writing [B, H, N], PDL-chained with its
        neighbours) for CUDA half-precision decode batches in graphs that replay as CUDA graphs, else "bmm" (over
        heads, then a transpose copy; without CUDA graphs a call of ours costs more host time than it saves).
        H200, HF H=16 32K greedy step, side by side, with q_b / o_proj also on the few-token kernel: 679.5 vs
        689.0 us a step; an Inductor multiply + sum was slower (747 vs 736 us).
    lone_linear_min_k, lone_linear_max_n: a bias-free linear without a partner (passes/fused_linear.py) goes to
        the few-token kernel when K >= min_k and N <= max_n: q_b_proj, o_proj, down_proj, not lm_head (whose wide
        GEMM suits cuBLAS). H200, same step: 679.5 vs 689.0 us with only K >= 8192 (down_proj); lm_head too was
        slower (744 vs 727 us).
    split_argmax_max_rows: passes/split_argmax.py splits argmax / argmin of at most this many rows (more rows fill
        the GPU already).

    fp8_scale_fmt: what the FP8 latent caches read under this tuning hold (mla_compile/fp8.py): None (any scales,
        e.g. amax / 448) or "ue8m0" (power-of-two scales: caches written with scale_fmt / fp8_scale_fmt "ue8m0").
        A promise about the data, read per op call: with "ue8m0" auto takes FlashMLA's V3.2 FP8 kernel at 128 heads
        where it takes the call (exact for such scales; H100 2026-12-06, H 128 32K: 190.9 vs 276.0 us at B 8, 698
        vs 1063 at B 32 for our FP8 kernel). Over a cache with other scales that kernel errs like a bf16 cache
        (lse off by ~0.05 at scores ~20), so promise it only for caches written that way; the data checks
        (MLA_COMPILE_CHECK_DATA=1 on CUDA, always on CPU tensors) hold every op reading an FP8 cache to it. A
        generate() call under optimize_generate over a cache written with fp8_scale_fmt "ue8m0" makes the promise
        itself; a compiled graph's own Tuning keeps a promise made around it (`within`).
    """

    decode_kernel: str = "auto"
    absorb: str = "auto"
    lone_linear_min_k: int = 1024
    lone_linear_max_n: int = 8192
    split_argmax_max_rows: int = 256
    fp8_scale_fmt: str | None = None

    def __post_init__(self):
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel: expected one of {', '.join(DECODE_KERNELS)}, got {self.decode_kernel!r}")
        if self.absorb not in ABSORB:
            raise ValueError(f"absorb: expected one of {', '.join(ABSORB)}, got {self.absorb!r}")
        if self.fp8_scale_fmt not in (None, "ue8m0"):
            raise ValueError(f"fp8_scale_fmt: expected None or 'ue8m0', got {self.fp8_scale_fmt!r}")
        for name in ("lone_linear_min_k", "lone_linear_max_n", "split_argmax_max_rows"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{name}: expected an int >= 0, got {value!r}")


FIELDS = tuple(f.name for f in dataclasses.fields(Tuning))
DEFAULT = Tuning()
_current: contextvars.ContextVar[Tuning] = contextvars.ContextVar("mla_compile_tuning", default=DEFAULT)


def current() -> Tuning:
    """The Tuning in effect: the innermost `use`, else the defaults."""
    return _current.get()


@contextlib.contextmanager
def use(tuning: Tuning):
    """Run the block under `tuning` (nested uses: the innermost wins; per thread / task, as context variables)."""
    if not isinstance(tuning, Tuning):
        raise TypeError(f"tuning: expected a Tuning, got {type(tuning).__name__}")
    token = _current.set(tuning)
    try:
        yield tuning
    finally:
        _current.reset(token)


def within(tuning: Tuning) -> Tuning:
    """`tuning` as it applies inside the one in effect now: a promise about the data (`fp8_scale_fmt`) made outside
    holds inside too (e.g. a cache of power-of-two scales handed to generate(), integrations/generate.py, around a
    model compiled with options of other fields)."""
    outer = _current.get().fp8_scale_fmt
    return tuning if outer is None or tuning.fp8_scale_fmt is not None else _promising(tuning, outer)


@functools.lru_cache(maxsize=64)
def _promising(tuning: Tuning, fp8_scale_fmt: str) -> Tuning:
    """`tuning` with a promise added, one object per pair (a bound graph asks on every call)."""
    return dataclasses.replace(tuning, fp8_scale_fmt=fp8_scale_fmt)


def bind(fn, tuning: Tuning):
    """fn, called under `tuning` every time (a compiled graph: its ops choose kernels when they run, and under
    CUDA graphs when they are recorded), as `within` it applies (a data promise made where fn is called holds). The
    defaults: fn itself, nothing added per call."""
    if tuning == DEFAULT:
        return fn

    @functools.wraps(fn)
    def under_tuning(*args, **kwargs):
        token = _current.set(within(tuning))
        try:
            return fn(*args, **kwargs)
        finally:
            _current.reset(token)

    return under_tuning


def from_options(options: Mapping[str, Any] | None) -> tuple[Tuning, dict[str, Any]]:
    """(the Tuning named by `options`' Tuning keys (FIELDS), the other options) for a backend: a bad value raises
    ValueError naming the key."""
    rest = dict(options or {})
    ours = {k: rest.pop(k) for k in FIELDS if k in rest}
    try:
        return Tuning(**ours), rest
    except ValueError as e:
        raise ValueError(f"options: {e}") from None


def decode_kernel() -> str:
    """The decode kernel asked for: `current().decode_kernel`, or, where that is "auto", MLA_COMPILE_DECODE_BACKEND
    (a process-wide switch; "auto" when unset)."""
    asked = current().decode_kernel
    if asked != "auto":
        return asked
    env = os.environ.get(DECODE_KERNEL_ENV, "auto").lower() or "auto"
    if env not in DECODE_KERNELS:
        raise ValueError(f"{DECODE_KERNEL_ENV}: expected one of {', '.join(DECODE_KERNELS)}, got {env!r}")
    return env


def swapab_tokens(default: bool) -> bool:
    """Whether a swap-AB kernel reads a page-size-1 token table in its TOKENS form (runs of consecutive rows as TMA
    boxes) rather than auto's other choice there: MLA_COMPILE_SWAPAB_TOKENS = 1 / 0, or, unset or "auto", `default`
    (the kernel's measured default: decode_swapab / decode_fp8_swapab `TOKENS_IN_AUTO`). Read when a plan is made
    (ops/_plans.py keys plans on this variable), so a test or an A/B run may set it per call."""
    env = os.environ.get(SWAPAB_TOKENS_ENV, "auto").lower() or "auto"
    if env not in ("auto", "1", "0"):
        raise ValueError(f"{SWAPAB_TOKENS_ENV}: expected auto, 1 or 0, got {env!r}")
    return default if env == "auto" else env == "1"
