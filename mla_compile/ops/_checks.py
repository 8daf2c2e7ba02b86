"""Input validation shared by every op implementation (fake, CPU, CUDA).

Two levels:
  * metadata checks (shape / dtype / device) run everywhere, including the fake impl, so a bad call fails
    at trace time with the same message it gives eagerly;
  * data checks (index ranges, lengths) read tensor values, so they run only where that costs no device
    sync: on CPU always, on CUDA only when ``MLA_COMPILE_CHECK_DATA=1`` (debugging).

An op's whole check is `@once_per_signature`: where no data check can run (CUDA without MLA_COMPILE_CHECK_DATA,
meta), a call whose shapes, strides, dtypes, devices and scalars passed before is not checked again. Building
every message and walking every rule costs ~60 us a call on one CPU core; the signature lookup ~5 us
(`python benchmarks/host_overhead.py`), and an eager call's host budget is tens of microseconds.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from .. import tuning as _tuning

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# the attention ops' plain-torch impls also take float64: the precision of references and gradcheck
REFERENCE_DTYPES = FLOAT_DTYPES + (torch.float64,)
INT32_MAX = 2**31 - 1


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of an attention op's lse (and of its math): float32, or float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fail(name: str, msg: str):
    raise ValueError(f"{name}: {msg}")


def check(cond: bool, name: str, msg: str) -> None:
    if not cond:
        fail(name, msg)


def check_tensor(t, name: str, ndim: int, dtypes=None) -> None:
    check(isinstance(t, torch.Tensor), name, f"expected a Tensor, got {type(t).__name__}")
    check(t.dim() == ndim, name, f"expected {ndim} dims, got shape {tuple(t.shape)}")
    if dtypes is not None:
        dtypes = dtypes if isinstance(dtypes, tuple) else (dtypes,)
        check(t.dtype in dtypes, name, f"expected dtype in {dtypes}, got {t.dtype}")


def check_dim(t: torch.Tensor, name: str, dim: int, size, what: str) -> None:
    check(t.shape[dim] == size, name, f"dim {dim} is {t.shape[dim]} but must equal {what} ({size})")


def check_same_device(named: dict) -> None:
    """Name the odd one out: the first argument not on the most common device (ties: the first arg's)."""
    devices = {n: t.device for n, t in named.items()}
    values = list(devices.values())
    common = max(values, key=lambda d: (values.count(d), -values.index(d)))
    common_name = next(n for n, d in devices.items() if d == common)
    for n, d in devices.items():
        check(d == common, n, f"is on {d} but {common_name} is on {common} (all inputs must share a device)")


DATA_ENV = "MLA_COMPILE_CHECK_DATA"


def data_checks_enabled(device: torch.device) -> bool:
    if device.type == "cpu":
        return True
    return os.environ.get(DATA_ENV, "0") == "1"


def is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake as _is_fake

    return _is_fake(t) or t.device.type == "meta"


_SCALARS = (bool, int, float, str, torch.dtype)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # model weights reach the linear ops as Parameters
_SEEN_LIMIT = 4096  # signatures remembered per check (a serving process sees a handful of shapes per op)
_PASSED: list[dict] = []  # every check's remembered signatures (forget_signatures clears them)


def _signature(args, key: list) -> bool:
    """Append what a metadata check may read of `args` to `key`; False where a check could read more: a tensor on
    the CPU (data checks read its values), another tensor subclass (FakeTensor), an object of another kind."""
    for a in args:
        if type(a) in _PLAIN_TENSORS:
            if a.is_cpu:
                return False
            key += (a.dtype, a.device, a.shape, a.stride())
        elif a is None:
            key.append(None)
        elif isinstance(a, _SCALARS):
            key += (type(a), a)  # 1, 1.0 and True hash alike; a check may take one and refuse another
        elif isinstance(a, (list, tuple)):
            key.append(len(a))
            if not _signature(a, key):
                return False
        else:
            return False
    return True


def once_per_signature(check_fn):
    """Decorator for an op's whole input check (it returns plain values, never tensors):
    where data checks cannot run, a call repeating a signature that passed returns that pass's result without
    checking again. Calls that raise are never remembered, so a bad call raises every time."""
    passed: dict = {}
    _PASSED.append(passed)

    @functools.wraps(check_fn)
    def check_once(*args, **kwargs):
        key: list = [*kwargs]
        if os.environ.get(DATA_ENV) == "1" or not _signature((*args, *kwargs.values()), key):
            return check_fn(*args, **kwargs)
        key = tuple(key)
        if key in passed:
            return passed[key]
        result = check_fn(*args, **kwargs)
        if len(passed) < _SEEN_LIMIT:
            passed[key] = result
        return result

    return check_once


def forget_signatures() -> None:
    """Check every later call in full again (benchmarks time a whole check this way)."""
    for passed in _PASSED:
        passed.clear()


def check_latent_rank(R: int, r_name: str) -> None:
    """The latent width R >= 1 (an MLA latent of width 0 attends to nothing). The rope width P may be 0:
    rope-less MLA (glm5_next, mistral_large4's `no_rope_layers`) scores with q_nope . ckv alone."""
    check(R >= 1, r_name, f"kv_lora_rank R (last dim) must be >= 1, got {R}")


def check_paged_cache(ckv_cache, kpe_cache, R: int, P: int, dtypes=FLOAT_DTYPES,
                      fp8_ok: bool = False) -> tuple[int, int]:
    """Latent cache pair [NP, PS, R] / [NP, PS, P] for queries of widths R >= 1 / P >= 0; returns
    (num_pages, page_size). fp8_ok: ckv_cache may also be the FP8 format's float8_e4m3fn (mla_compile/fp8.py)."""
    check_latent_rank(R, "q_nope")
    check_tensor(ckv_cache, "ckv_cache", 3, dtypes + (torch.float8_e4m3fn,) if fp8_ok else dtypes)
    check_tensor(kpe_cache, "kpe_cache", 3, dtypes)
    check_dim(ckv_cache, "ckv_cache", 2, R, "q_nope.shape[-1] (kv_lora_rank R)")
    check_dim(kpe_cache, "kpe_cache", 2, P, "q_pe.shape[-1] (rope dim P)")
    check(kpe_cache.shape[:2] == ckv_cache.shape[:2], "kpe_cache",
          f"pages/page size {tuple(kpe_cache.shape[:2])} differ from ckv_cache {tuple(ckv_cache.shape[:2])}")
    check(ckv_cache.shape[1] > 0, "ckv_cache", "page size must be positive")
    return ckv_cache.shape[0], ckv_cache.shape[1]


def check_block_table(block_table, seq_lens, B: int, lens: str = "seq_lens") -> None:
    """`lens`: the lengths argument's name in the errors."""
    check_tensor(block_table, "block_table", 2, torch.int32)
    check_tensor(seq_lens, lens, 1, torch.int32)
    check_dim(block_table, "block_table", 0, B, "the batch size")
    check_dim(seq_lens, lens, 0, B, "the batch size")


def check_block_table_data(block_table, seq_lens, num_pages: int | None, page_size: int,
                           int32_slots: bool = False, lens: str = "seq_lens") -> None:
    """Values: lengths in [0, capacity]; pages a request uses are >= 0 and index real pages (< num_pages,
    unless num_pages is None: an op without the cache cannot know how many there are). int32_slots: the op
    returns the slots as int32, so every used slot page * page_size + offset must fit (no silent wrap)."""
    if is_fake(seq_lens) or not data_checks_enabled(seq_lens.device):
        return
    capacity = block_table.shape[1] * page_size
    if seq_lens.numel():
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        check(lo >= 0, lens, f"lengths must be >= 0, got {lo}")
        check(hi <= capacity, lens,
              f"length {hi} exceeds the block table's capacity {capacity} (= {block_table.shape[1]} pages x {page_size})")
    # tokens of each row on each of its pages (0 on pages past its length)
    first = torch.arange(block_table.shape[1], device=block_table.device)[None, :] * page_size
    on_page = (seq_lens.long()[:, None] - first).clamp(0, page_size)
    used = on_page > 0
    if not used.any():
        return
    pages = block_table[used].long()
    lo, hi = int(pages.min()), int(pages.max())
    check(lo >= 0, "block_table", f"page indices must be >= 0, saw {lo}")
    if num_pages is not None:
        check(hi < num_pages, "block_table", f"page index out of range [0, {num_pages}): saw {hi}")
    if int32_slots:
        last = int((pages * page_size + on_page[used] - 1).max())  # the largest slot a used token sits at
        check(last <= INT32_MAX, "block_table",
              f"slot {last} (= page * page_size + offset, page_size {page_size}) does not fit int32")


def is_int(v) -> bool:
    """An int argument's test: Python's bool is an int, but True passed as a length, a count or a scale is a
    mistake, not 1."""
    return isinstance(v, int) and not isinstance(v, bool)


def check_scale(sm_scale, name: str = "sm_scale") -> None:
    check((isinstance(sm_scale, float) or is_int(sm_scale)) and math.isfinite(sm_scale), name,
          f"expected a finite float, got {sm_scale!r}")


def check_ckv_scale(ckv_cache, ckv_scale, cache_name: str = "ckv_cache", scale_name: str = "ckv_scale") -> None:
    """The FP8 latent cache's scales (mla_compile/fp8.py): required, float32 [NP, PS, R / 128], when the cache is
    float8_e4m3fn; None for any other cache dtype (a scale beside a bf16 cache would be silently ignored)."""
    from .. import fp8

    if not fp8.is_fp8(ckv_cache):
        check(ckv_scale is None, scale_name, f"given for a {ckv_cache.dtype} {cache_name}: scales belong to a "
                                             f"{fp8.DTYPE} cache only (pass None)")
        return
    check(ckv_scale is not None, scale_name, f"required: {cache_name} is {fp8.DTYPE}, whose values are read as "
                                             f"value * scale (float32 [NP, PS, R / {fp8.GROUP}])")
    check(isinstance(ckv_scale, torch.Tensor), scale_name, f"expected a Tensor, got {type(ckv_scale).__name__}")
    check(ckv_scale.dtype == fp8.SCALE_DTYPE, scale_name, f"expected dtype {fp8.SCALE_DTYPE}, got {ckv_scale.dtype}")
    R = ckv_cache.shape[-1]
    check(R % fp8.GROUP == 0, cache_name, f"an FP8 cache needs R (last dim) a multiple of {fp8.GROUP} (one scale "
                                          f"per {fp8.GROUP} channels), got {R}")
    want = (*ckv_cache.shape[:-1], R // fp8.GROUP)
    check(tuple(ckv_scale.shape) == want, scale_name, f"expected shape {want} ([NP, PS, R / {fp8.GROUP}] of "
                                                      f"{cache_name} {tuple(ckv_cache.shape)}), got "
                                                      f"{tuple(ckv_scale.shape)}")
    check(ckv_scale.device == ckv_cache.device, scale_name, f"is on {ckv_scale.device} but {cache_name} is on "
                                                            f"{ckv_cache.device}")
    _check_promised_scales(ckv_scale, scale_name)


def _check_promised_scales(ckv_scale, scale_name: str) -> None:
    """Under Tuning.fp8_scale_fmt "ue8m0" (the caller's promise that lets auto read with FlashMLA's FP8 kernel, exact
    only then), with data checks on: every finite nonzero scale a power of two (unwritten slots may hold anything
    else: zeros, NaN bytes)."""
    if _tuning.current().fp8_scale_fmt != "ue8m0" or is_fake(ckv_scale) or not data_checks_enabled(ckv_scale.device):
        return
    written = ckv_scale[torch.isfinite(ckv_scale) & (ckv_scale != 0)]
    off = written[torch.frexp(written).mantissa.abs() != 0.5]
    check(off.numel() == 0, scale_name, f"Tuning.fp8_scale_fmt 'ue8m0' promises power-of-two scales, but "
                                        f"{off.numel()} are not (e.g. {off[:1].tolist()}): write the cache with "
                                        f"scale_fmt / fp8_scale_fmt 'ue8m0', or drop the promise")
