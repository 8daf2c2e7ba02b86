"""Intermediate buffers without allocations per call: a scratch buffer reused by the calls one thread makes on the
legacy default CUDA stream.

A split decode writes float32 partials (o [ns, B, H, R], lse [ns, B, H]) that only its own merge reads; a split-K
few-token linear writes partial products only its sum reads. Allocated per call, they are two of the four
`torch.empty` an eager `mla.decode` pays on the host (~4 us each on the H200 host, benchmarks/host_overhead.py), and
the linear's also takes a column view per weight. Reusing one buffer is safe where every user of it is ordered after
the previous one:
  * the legacy default stream (raw handle 0) orders all work queued on it, and a CUDA graph is never captured on it
    (capture needs another stream), so no graph bakes the buffer's address into its replays;
  * Inductor's CUDA-graph trees warm up and record on a stream of their own, whose allocations go to the graph pool:
    a call there allocates fresh partials, as does any call on a side stream (no ordering with other streams);
  * one buffer per thread: two threads queueing on the default stream interleave their launches.
Any other stream, or a CPU tensor: fresh allocations (what every call did before).

The buffer grows (to at least twice its size) when a plan needs more; a plan's cached views keep the old buffer
alive until it next runs (the views carry the buffer's generation), so at most the last few sizes are held.

Counters ride on the same rule: int32 slots that are zero before and after every launch that uses them (a split
kernel's programs count their arrivals and the last one of a group, having summed the group's partials, puts its
slot back to 0). That saves the summing launch, but the slots must outlive every launch and stay outside any graph
pool, and two launches must never hold them at once: true on the legacy default stream for the same reasons as the
scratch buffer, so a plan gets them there only, and elsewhere None (its caller then launches the sum apart).
"""

from __future__ import annotations

import functools
import threading

import torch

_local = threading.local()
_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_ALIGN = 128  # float32 elements (512 bytes): every view starts aligned as a fresh allocation (Triton keys on it)


_SCALARS: dict = {}  # (dtype, device) -> one element made on the legacy default stream: `empty_maker`'s templates


def empty_maker(shape, dtype: torch.dtype, device: torch.device):
    """`fresh()` -> a new uninitialised contiguous tensor of (shape, dtype, device), for a plan's outputs. Where it
    is safe, `torch.empty_like` of a one-element template expanded to the shape (an expanded tensor is not dense, so
    empty_like allocates row-major): half of torch.empty's host time (it parses no size / dtype / device; 0.6 vs 1.3
    us on a laptop core, benchmarks/lab/host_cpu.py). Safe: the template was made outside any CUDA-graph pool, i.e.
    on the legacy default stream (as `Scratch`'s buffer; cudagraph trees warm up and record on a stream of their
    own, whose allocations their pool accounts for), or on the CPU. Elsewhere `torch.empty` each call."""
    device, shape = torch.device(device), tuple(shape)
    key = (dtype, device)
    scalar = _SCALARS.get(key)
    if scalar is None and (device.type != "cuda" or (_stream is not None and _stream(
            device.index if device.index is not None else torch.cuda.current_device()) == 0)):
        scalar = _SCALARS[key] = torch.empty((), dtype=dtype, device=device)
    # (an empty shape too: empty_like would give it zero strides, torch.empty row-major ones, as fake impls do)
    if scalar is None or 0 in shape:
        return functools.partial(torch.empty, shape, dtype=dtype, device=device)
    return functools.partial(torch.empty_like, scalar.expand(shape))


class _Buffer:
    __slots__ = ("data", "generation", "counters")

    def __init__(self):
        self.data, self.generation, self.counters = None, 0, None

    def reserve_counters(self, n: int, device: torch.device) -> None:
        if n and (self.counters is None or self.counters.numel() < n):
            # zeroed once, on the default stream this buffer serves; every user leaves its slots at 0 again. At
            # least 1024 slots (a split-K linear takes one per 32 weight rows): one allocation for most models
            self.counters = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
            self.generation += 1

    def reserve(self, numel: int, device: torch.device) -> None:
        if self.data is None or self.data.numel() < numel:
            grown = 0 if self.data is None else 2 * self.data.numel()
            self.data = torch.empty(max(numel, grown), dtype=torch.float32, device=device)
            self.generation += 1


def _buffer(device_index: int) -> _Buffer:
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(device_index)
    if buf is None:
        buf = buffers[device_index] = _Buffer()
    return buf


class Scratch:
    """A plan's float32 scratch tensors: `get()` -> one contiguous tensor per shape, then whatever `derive(*tensors)`
    makes of them (e.g. column views). Where it is safe (see the module docstring) they are views of this thread's
    default-stream buffer, 512-byte aligned as a fresh allocation is and made once per buffer generation: such a call
    pays no allocation and no view. Elsewhere `fresh()`: new tensors each call. With `counters` > 0 the tensors
    are followed by that many int32 arrival counters (zero; see the module docstring), or by None where the
    tensors are fresh."""

    __slots__ = ("shapes", "offsets", "numel", "derive", "device", "index", "views", "counters")

    def __init__(self, shapes, device: torch.device, derive=None, counters: int = 0):
        self.shapes, self.device, self.derive = [tuple(s) for s in shapes], device, derive
        self.counters = counters
        self.offsets, end = [], 0
        for shape in self.shapes:
            self.offsets.append(end)
            end += -(-torch.Size(shape).numel() // _ALIGN) * _ALIGN
        self.numel = end
        self.index = device.index if device.type == "cuda" and device.index is not None else (
            torch.cuda.current_device() if device.type == "cuda" else -1)
        self.views = None  # (buffer, generation, views)

    def fresh(self):
        tensors = tuple(torch.empty(shape, dtype=torch.float32, device=self.device) for shape in self.shapes)
        tensors = tensors if self.derive is None else self.derive(*tensors)
        return tensors + (None,) if self.counters else tensors

    def get(self):
        index = self.index
        if index < 0 or _stream is None or _stream(index) != 0:
            return self.fresh()
        try:  # every split call asks: the thread's buffer without `_buffer`'s frame where it exists
            buf = _local.buffers[index]
        except (AttributeError, KeyError):
            buf = _buffer(index)
        v = self.views
        if v is not None and v[0] is buf and v[1] == buf.generation:
            return v[2]
        buf.reserve(self.numel, self.device)
        buf.reserve_counters(self.counters, self.device)
        views = tuple(buf.data[start:start + torch.Size(shape).numel()].view(shape)
                      for start, shape in zip(self.offsets, self.shapes))
        if self.derive is not None:
            views = self.derive(*views)
        if self.counters:
            views = views + (buf.counters[:self.counters],)
        self.views = (buf, buf.generation, views)
        return views
