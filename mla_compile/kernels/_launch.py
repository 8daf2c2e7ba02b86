"""A cached launch path for our Triton kernels.

Triton's `JITFunction.run` binds every argument per call (a generated function that calls the specializer once per
argument), turns the specialization into a key string, then calls the compiled kernel's C launcher. For our decode
kernel (37 arguments) the binding and key cost ~22 us of host time per launch on one CPU core
(benchmarks/host_overhead.py), paid by every eager call and every default-mode compiled step.

`fast(fn)` wraps a `@triton.jit` function. The first call with a new argument signature goes through Triton
(which compiles, or finds the compiled kernel) and the compiled kernel is remembered under a key we build cheaply;
later calls with that key go straight to its launcher. The key holds everything Triton specializes on, or more:
  tensors        dtype and 16-byte alignment of the data pointer (Triton: pointer type and the "divisible by 16"
                 attribute)
  ints           the value itself (Triton: i32 / i64 / u64 by range, == 1, divisible by 16)
  bools, None    the value (Triton: u1, constexpr None); bools kept apart from the ints 0 / 1
  floats         the type only (Triton: fp32, never specialized on the value)
  descriptors    dtype, shape, strides, block shape, padding, layout (Gluon), base alignment (a superset of
                 Triton's)
  keywords       every keyword argument verbatim (constexprs, launch options), and the current device
Anything else (a grid function, a tensor passed by keyword, launch hooks installed by a profiler, the CPU
interpreter) takes Triton's own path every call. Not repeated on the cached path: Triton's check that the module
globals a kernel read at compile time are unchanged (ours are constants, never reassigned). Triton's own `run` also
builds launch metadata for its (empty by default) hook chain on every launch; the cached path skips that where no
hook is installed.

`bind(fn, grid, **kwargs)` goes one step further for a caller that already keys its calls (a per-signature launch
plan: ops/_plans.py, kernels/decode.py `AttendPlan`): the grid and the keywords are fixed and every call's
positional arguments give the same key (same ints, floats, dtypes and alignments; the caller's key guarantees it),
so after the first launch the compiled kernel's launcher is called with no key built at all. Its kernel is the one
chosen under the Triton knobs of that first launch (debug, instrumentation): a bound launch does not follow a later
change of them.
"""

from __future__ import annotations

import os

import torch
from triton import knobs
from triton.runtime.driver import driver

from ._util import _INTERPRETED

# MLA_COMPILE_FAST_LAUNCH=0: every launch through Triton's own run (an escape hatch, and the benchmark's baseline)
ENABLED = os.environ.get("MLA_COMPILE_FAST_LAUNCH", "1") != "0"
_FLOAT = object()  # key entry of every float argument: Triton passes floats as fp32 values, unspecialized
_MAX_KEYS = 512  # per kernel; reached only by a stream of new shapes (each one also compiles or looks up in Triton)


def _tensor_key(t: torch.Tensor):
    return t.dtype, t.data_ptr() & 15 == 0


def _descriptor_key(d):
    # Gluon's descriptors carry their shared-memory layout too (a frozen, hashable dataclass)
    return (type(d), d.base.dtype, tuple(d.shape), tuple(d.strides), tuple(d.block_shape), d.padding,
            getattr(d, "layout", None), d.base.data_ptr() & 15 == 0)


def _is_descriptor(a) -> bool:
    return hasattr(a, "block_shape")  # triton.tools.tensor_descriptor / Gluon's TensorDescriptor


def _arg_key(a):
    """Key entry of a non-int argument (ints enter the key as themselves, inline in `launch`)."""
    t = type(a)
    if a is None:
        return a
    if t is float:
        return _FLOAT
    if t is bool:
        return ("bool", a)
    if isinstance(a, torch.Tensor):
        return _tensor_key(a)
    if _is_descriptor(a):
        return _descriptor_key(a)
    raise _Uncacheable


def _hook_set(hook) -> bool:
    # Triton 3.6 keeps launch hooks in a HookChain (an empty one by default); older versions: a function or None
    return hook is not None and getattr(hook, "calls", True) != []


_RUNTIME = knobs.runtime  # Triton's one runtime-knobs object: hooks are installed on it, it is never replaced
_CHAIN = getattr(knobs, "HookChain", None)  # Triton 3.6's hook container (older versions: the generic test)


def _hooks_installed() -> bool:
    """A profiler's launch hooks (proton, ...) see Triton's launch metadata: such launches take Triton's path. Without
    hooks the launcher is given None for them (what an empty chain amounts to) and no metadata. Asked before every
    bound launch: the common answer (two empty chains) is read without a call (half the time of `_hook_set` twice)."""
    enter, exit_ = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
    if _CHAIN is not None and type(enter) is _CHAIN and type(exit_) is _CHAIN:
        return bool(enter.calls or exit_.calls)
    return _hook_set(enter) or _hook_set(exit_)


def _key(device, args: tuple, kwargs: dict) -> tuple:
    # ints (most arguments) inline: a call of _arg_key per argument costs ~0.15 us each
    return (device, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
            tuple([a if type(a) is int else _arg_key(a) for a in args]), tuple(kwargs.items()))


class _Uncacheable(Exception):
    """An argument of a kind the key does not cover: Triton's own path for this call."""


class _Entry:
    __slots__ = ("kernel", "run", "function", "packed_metadata", "tail")

    def __init__(self, kernel, tail):
        self.kernel, self.run, self.function, self.packed_metadata, self.tail = (
            kernel, kernel.run, kernel.function, kernel.packed_metadata, tail)


class FastLaunch:
    """`fast(fn)[grid](*args, **kwargs)` launches as `fn[grid](*args, **kwargs)` does; everything else
    (`.fn`, `.warmup`, `.cache` ...) is the wrapped JITFunction's."""

    def __init__(self, fn):
        self.jit_function = fn
        self._entries: dict = {}

    def __getattr__(self, name):
        return getattr(self.jit_function, name)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def launch(self, grid, args: tuple, kwargs: dict):
        if _INTERPRETED or not ENABLED or type(grid) is not tuple or _hooks_installed():
            return self.jit_function[grid](*args, **kwargs)
        active = driver.active
        device = active.get_current_device()
        try:
            key = _key(device, args, kwargs)
            entry = self._entries.get(key)
        except (_Uncacheable, TypeError):  # TypeError: an unhashable keyword value
            return self.jit_function[grid](*args, **kwargs)
        if entry is None:
            return self._first_launch(key, device, grid, args, kwargs)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        entry.run(grid[0], g1, g2, active.get_current_stream(device), entry.function, entry.packed_metadata,
                  None, None, None, *args, *entry.tail)
        return entry.kernel

    def entry(self, grid, args: tuple, kwargs: dict) -> _Entry | None:
        """The remembered compiled kernel these arguments launch (None: not remembered, or not cacheable)."""
        if type(grid) is not tuple:
            return None
        try:
            return self._entries.get(_key(driver.active.get_current_device(), args, kwargs))
        except (_Uncacheable, TypeError):
            return None

    def _first_launch(self, key, device, grid, args, kwargs):
        kernel = self.jit_function[grid](*args, **kwargs)
        if kernel is None:
            return kernel
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            kernel = kernel.result()
        # the arguments after the positional ones, in signature order: keywords and defaults, all fixed by the key
        binder = self.jit_function.device_caches[device][4]
        bound, _, _ = binder(*args, **kwargs)
        tail = tuple(bound.values())[len(args):]
        if any(isinstance(v, torch.Tensor) or _is_descriptor(v) for v in tail):
            return kernel  # a tensor by keyword: its identity is not in the key, so never replayed from it
        if len(self._entries) >= _MAX_KEYS:
            self._entries.clear()
        self._entries[key] = _Entry(kernel, tail)
        return kernel


def _raw_launcher(entry: _Entry):
    """(the C launcher, the arguments Triton's CudaLauncher adds before the kernel's, the descriptor expansion) where
    that wrapper adds nothing else: no global or profile scratch to allocate. Its Python __call__ costs ~9 us a launch
    on the H200 host (benchmarks/host_overhead.py profile). None for any other launcher (another backend or Triton
    version, the tests' fake driver): the kernel's own run then. The expansion: `_tensor_map_launcher`."""
    run = entry.run
    raw = getattr(run, "launch", None)
    if (_device is None or _stream is None or type(run).__name__ != "CudaLauncher" or raw is None
            or getattr(run, "global_scratch_size", 1) != 0 or getattr(run, "profile_scratch_size", 1) != 0
            or not hasattr(run, "launch_pdl")):
        return None
    raw, descriptors = _tensor_map_launcher(raw)
    # CudaLauncher.__call__: launch(grid, stream, function, cooperative, pdl, global_scratch, profile_scratch,
    # packed_metadata, launch_metadata, enter_hook, exit_hook, *kernel_args)
    return raw, (run.launch_cooperative_grid, run.launch_pdl, None, None, entry.packed_metadata, None, None,
                 None), descriptors


_MAX_TENSOR_MAPS = 512  # per bound launch: two or three per layer's cache; reached only by a stream of new buffers


def _tensor_map_launcher(launch):
    """(the C launcher, ((position, metadata), ...)) where `launch` is Triton's Python wrapper around it for a
    kernel taking TMA descriptors (triton/backends/nvidia/driver.py `wrap_handle_tensordesc`): per launch it walks
    every argument in Python and encodes each descriptor into a CUtensorMap with a driver call (~6 us of Python a
    launch for a Gluon decode kernel's ~40 arguments, on one CPU core). A bound launch does that itself, encoding a
    descriptor once per (position, base address): the shape, strides, box and layout are fixed by the plan's
    signature (`Bound`), so the map depends on the base address alone. (launch, None) for any other launcher, or a
    descriptor Triton decomposes without metadata (its expansion holds the tensor itself)."""
    if _WRAPPER_CODE is None or getattr(launch, "__code__", None) is not _WRAPPER_CODE:
        return launch, None
    cells = dict(zip(_WRAPPER_CODE.co_freevars, launch.__closure__ or ()))
    try:
        c_launch = cells["launcher"].cell_contents
        indices = sorted(cells["tensordesc_indices"].cell_contents)
        metas = list(cells["tensordesc_meta"].cell_contents)
    except (KeyError, ValueError):  # another Triton's wrapper
        return launch, None
    if not indices or len(metas) != len(indices) or any(m is None for m in metas):
        return launch, None
    return c_launch, tuple(zip(indices, metas))


def _wrapper_code():
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:  # pragma: no cover - a Triton without the NVIDIA backend
        return None, None
    wrap = getattr(nvidia, "wrap_handle_tensordesc", None)
    expand = getattr(nvidia, "make_tensordesc_arg", None)
    if wrap is None or expand is None:
        return None, None
    inner = [c for c in wrap.__code__.co_consts if getattr(c, "co_name", None) == "inner"]
    return (inner[0] if len(inner) == 1 else None), expand


_WRAPPER_CODE, _expand_descriptor = _wrapper_code()


class Bound:
    """One launch of a plan: `bound(*args)` launches `fn[grid](*args, **kwargs)` and returns the compiled kernel.
    The caller promises that every call's positional arguments key alike (see the module docstring; a TMA
    descriptor's key is its dtype, shape, strides, box, padding and layout); the first call goes through `fast(fn)`
    and remembers its compiled kernel, later ones call its launcher directly (the C launcher itself where
    `_raw_launcher` allows, on the current CUDA device's current stream, each descriptor's CUtensorMap encoded
    once per base address).

    `templates` {position: descriptor template (`without_bases`)}: the caller passes each of those descriptors' base
    tensor at its position instead of the descriptor. A launch from the tensor-map cache then reads only the base's
    address (no descriptor object made per call: `rebased` costs ~0.6 us a descriptor on one CPU core); every other
    path gets the descriptors, rebased over the bases."""

    __slots__ = ("fast", "grid", "kwargs", "entry", "g", "raw", "head", "tail", "descriptors", "tensor_maps",
                 "templates")

    def __init__(self, fn, grid: tuple, kwargs: dict, templates: dict | None = None):
        self.fast, self.grid, self.kwargs, self.entry, self.raw = fast(fn), grid, kwargs, None, None
        self.g = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
        self.descriptors, self.tensor_maps = None, {}
        self.templates = dict(sorted(templates.items())) if templates else None

    def __call__(self, *args):
        e = self.entry
        if e is None or not ENABLED or _hooks_installed():
            full = self._with_descriptors(args) if self.templates else args
            kernel = self.fast.launch(self.grid, full, self.kwargs)
            if e is None and ENABLED and not _INTERPRETED:
                e = self.fast.entry(self.grid, full, self.kwargs)
                if e is not None:
                    self.remember(e, len(args))
            return kernel
        if self.raw is not None:
            g = self.g
            if self.descriptors is not None:
                args = self._with_tensor_maps(args)
            elif self.templates:
                args = self._with_descriptors(args)
            self.raw(g[0], g[1], g[2], _stream(_device()), *self.head, *args, *self.tail)
            return e.kernel
        if self.templates:
            args = self._with_descriptors(args)
        active = driver.active
        e.run(*self.g, active.get_current_stream(active.get_current_device()), e.function, e.packed_metadata,
              None, None, None, *args, *e.tail)
        return e.kernel

    def _with_descriptors(self, args: tuple) -> tuple:
        """`args` with each templated position's base tensor replaced by its descriptor (`rebased`)."""
        out = list(args)
        for p, d in zip(self.templates, rebased(self.templates.values(), [args[p] for p in self.templates])):
            out[p] = d
        return tuple(out)

    def remember(self, entry: _Entry, n_args: int) -> None:
        """Launch `entry` from now on: its C launcher and what every launch passes around the call's own arguments
        where `_raw_launcher` allows, else its run."""
        self.entry = entry
        raw = _raw_launcher(entry)
        if raw is None:
            return
        self.raw, fixed, descriptors = raw
        self.head, self.tail = (entry.function, *fixed), entry.tail
        if descriptors is None:
            return
        if descriptors[-1][0] >= n_args:  # not reached: `fast` never remembers a descriptor passed by keyword
            self.raw = None
            return
        if self.templates and tuple(self.templates) != tuple(p for p, _ in descriptors):
            self.raw = None  # the wrapper's descriptors are not the templated positions: Triton's run, as made
            return
        ends = [p for p, _ in descriptors[1:]] + [None]  # (position, metadata, end of the arguments after it)
        self.descriptors = tuple((p, m, end) for (p, m), end in zip(descriptors, ends))

    def _with_tensor_maps(self, args: tuple) -> tuple:
        """`args` with each descriptor replaced by what Triton's wrapper passes the C launcher for it (the
        CUtensorMap, then the shape and strides), encoded on the first call with its base address."""
        maps, based = self.tensor_maps, self.templates is not None
        out = args[:self.descriptors[0][0]]
        for p, meta, end in self.descriptors:
            d = args[p]
            key = (p, d.data_ptr() if based else d.base.data_ptr())
            expanded = maps.get(key)
            if expanded is None:
                if len(maps) >= _MAX_TENSOR_MAPS:
                    maps.clear()
                if based:
                    d = rebased((self.templates[p],), (d,))[0]
                expanded = maps[key] = tuple(_expand_descriptor(d, meta))
            out += expanded + args[p + 1:end]
        return out


# what Triton's CUDA driver asks for the current device and stream, without torch.cuda.current_device's Python
_device = getattr(torch._C, "_cuda_getDevice", None)
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def bind(fn, grid: tuple, templates: dict | None = None, **kwargs) -> Bound:
    """`Bound(fn, grid, kwargs, templates)`: `templates` {position: descriptor template}, see `Bound`."""
    return Bound(fn, grid, kwargs, templates)


def without_bases(descriptors) -> tuple:
    """TMA descriptors (Triton's or Gluon's) as a plan keeps them: validated once, holding no tensor."""
    for d in descriptors:
        d.base = None
    return tuple(descriptors)


def templated_at(first: int, templates) -> dict:
    """`bind`'s templates: descriptor templates at consecutive argument positions from `first` (the caller passes
    each one's base tensor there)."""
    return dict(enumerate(templates, first))


def rebased(templates, bases) -> list:
    """A call's TMA descriptors: copies of a plan's templates (`without_bases`) over these bases. Shape, strides, box
    and alignment are fixed by the plan's signature; a fresh descriptor re-validates all of it in Python (~5 us
    each). The launcher reads only a base's data pointer, so a base may be the tensor the template's view was taken
    of (a cache viewed as [slots, width])."""
    out = []
    for template, base in zip(templates, bases):
        d = object.__new__(type(template))
        d.__dict__.update(template.__dict__)
        d.base = base
        out.append(d)
    return out


def fast(fn) -> FastLaunch:
    """`fast(kernel)[grid](...)`: launch a `@triton.jit` (or Gluon) function through the cached path (one wrapper per
    function, made on first use and kept on the function: JITFunction hashes its source, ~0.6 us a dict lookup);
    under TRITON_INTERPRET=1 every call takes the interpreter."""
    try:
        return fn.__dict__["_mla_fast_launch"]
    except KeyError:
        wrapped = fn.__dict__["_mla_fast_launch"] = FastLaunch(fn)
        return wrapped
