"""How every op of ours is registered: `define`, on torch.library's low-level API (`Library.define` + `impl`).

Why not `torch.library.custom_op`: it wraps every call in Python layers of its own (a dynamo-disabled shim, an
autograd wrapper even for ops without a formula, and a per-call check that no output aliases an input). On one CPU
core that is ~10 us of dispatcher time a call against ~2 us for a kernel registered with `Library.impl`
(`python benchmarks/host_overhead.py`), and every eager call and every op of a default-mode compiled graph (no CUDA
graphs) pays it. vLLM registers its ops the low-level way for the same reason (`direct_register_custom_op`).

What custom_op did that we keep: the `pt2_compliant_tag`; fake impls (`torch.library.register_fake`: FakeTensor
and meta); autograd formulas (`torch.library.register_autograd`, functional ops only); and for mutating ops the
version-counter bump (the ADInplaceOrView kernel), so autograd still notices a tensor it saved being overwritten.
An op without an autograd formula gets PyTorch's autograd fallback (a warning if a backward reaches it): ours
without one return integers or write caches.
"""

from __future__ import annotations

import functools

import torch

_LIBRARIES: dict[str, torch.library.Library] = {}  # namespace -> its fragment (kept alive: dropping one unregisters)
OPS: dict[str, "Op"] = {}  # qualname -> every op defined here (benchmarks/lab/host_cpu.py reroutes their impls)


def _library(namespace: str) -> torch.library.Library:
    if namespace not in _LIBRARIES:
        _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return _LIBRARIES[namespace]


def _dispatch_key(device_type: str) -> str:
    return torch._C._dispatch_key_for_device(device_type)


class Op:
    """A registered op: call it like the function it wraps (the call goes through the dispatcher, so it reaches the
    impl of the inputs' device), and register more impls with the decorators custom_op users know."""

    def __init__(self, qualname: str, impl, schema: str, mutates_args, device_types, tags):
        self.namespace, self.name = qualname.split("::")
        self.qualname = qualname
        self._lib = _library(self.namespace)
        self._lib.define(self.name + schema, tags=(torch.Tag.pt2_compliant_tag, *tags))
        self.default = getattr(getattr(torch.ops, self.namespace), self.name).default
        schema_obj = self.default._schema
        mutated = {a.name for a in schema_obj.arguments if a.alias_info is not None and a.alias_info.is_write}
        if mutated != set(mutates_args):
            raise ValueError(f"{qualname}: mutates_args {sorted(mutates_args)} differ from the schema's written "
                             f"arguments {sorted(mutated)}")
        if mutated:
            self._register_version_bump(schema_obj)
        functools.update_wrapper(self, impl)
        OPS[qualname] = self
        self._kernels = {}  # DispatchKey -> our kernel registered for it (the no-grad shortcut's targets)
        self._below = {}  # a keyset's raw bits -> our kernel the shortcut takes for it, or None (kept per keyset)
        if device_types is None:  # one kernel for every device
            self._lib.impl(self.name, impl, "CompositeExplicitAutograd")
        for device in () if device_types is None else (device_types,) if isinstance(device_types, str) else device_types:
            self.register_kernel(device)(impl)

    def __call__(self, *args, **kwargs):
        return self.default(*args, **kwargs)

    def register_kernel(self, device_type: str):
        def register(fn):
            key = _dispatch_key(device_type)
            self._lib.impl(self.name, fn, key)
            self._kernels[getattr(torch._C.DispatchKey, key)] = fn
            self._below.clear()
            return fn

        return register

    def register_fake(self, fn):
        torch.library.register_fake(self.qualname, fn, lib=self._lib)
        return fn

    def register_autograd(self, backward, *, setup_context=None) -> None:
        """torch.library.register_autograd's formula, behind a leaner no-grad path: where no input requires grad
        (every inference call) the call goes straight below autograd. torch.library's own kernel builds a metadata
        object and a context per call there: ~8 us of host time a call on one CPU core against ~5 us."""
        try:
            from torch._library.autograd import Info, make_autograd_impl
        except ImportError:  # pragma: no cover - a torch without the helper: its own (slower) kernel
            torch.library.register_autograd(self.qualname, backward, setup_context=setup_context, lib=self._lib)
            return
        if not torch._library.utils.is_functional_schema(self.default._schema):
            raise RuntimeError(f"{self.qualname}: an autograd formula needs a functional schema")
        with_grad = make_autograd_impl(self.default, Info(backward, setup_context))
        op, below = self.default, torch._C._after_autograd_keyset
        # below autograd a functional op's dense tensors also carry ADInplaceOrView, a fallthrough for it
        backend_keys = below.remove(torch._C.DispatchKey.ADInplaceOrView)
        kernels, by_keyset = self._kernels, self._below
        grad_enabled, any_requires_grad, unseen = torch._C.is_grad_enabled, torch._C._any_requires_grad, object()

        def kernel_below(keyset):
            kernel = by_keyset[keyset.raw_repr()] = kernels.get((keyset & backend_keys).highestPriorityTypeId())
            return kernel

        def autograd_kernel(keyset, *args, **kwargs):
            if grad_enabled() and any_requires_grad(*args):
                return with_grad(keyset, *args, **kwargs)
            # where nothing but a backend lies below (no mode, subclass, functionalization: their keys rank above
            # the backends), our kernel for it is what the redispatch would reach: called directly, it saves the
            # dispatcher's second pass (~5 us a call on the H200 host, benchmarks/host_overhead.py profile)
            kernel = by_keyset.get(keyset.raw_repr(), unseen)
            if kernel is unseen:
                kernel = kernel_below(keyset)
            if kernel is not None:
                return kernel(*args, **kwargs)
            with torch._C._AutoDispatchBelowAutograd():
                return op.redispatch(keyset & below, *args, **kwargs)

        self._lib.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)

    def _register_version_bump(self, schema) -> None:
        """In-place writes bump the written tensors' version counters (what an aten in-place op does), then the call
        goes on to the backend kernel."""
        written = [i for i, a in enumerate(schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
        op, below = self.default, torch._C._after_ADInplaceOrView_keyset

        def bump_versions(keyset, *args, **kwargs):
            for i in written:
                t = args[i] if i < len(args) else kwargs.get(schema.arguments[i].name)
                if isinstance(t, torch.Tensor):
                    torch.autograd.graph.increment_version(t)
            return op.redispatch(keyset & below, *args, **kwargs)

        self._lib.impl(self.name, bump_versions, "ADInplaceOrView", with_keyset=True)


def define(qualname: str, *, schema: str, mutates_args=(), device_types="cpu", tags=()):
    """Decorator: `qualname` ("ns::name") with `schema` ("(Tensor x, ...) -> Tensor"), the decorated function its
    kernel for `device_types` (None: every device); `mutates_args` names the arguments the schema marks written (checked against it)."""
    return lambda impl: Op(qualname, impl, schema, mutates_args, device_types, tags)
