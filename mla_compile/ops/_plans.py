"""Per-signature call plans for the ops' CUDA impls: what an eager call (or a default-mode compiled graph, which
calls the op the same way) pays on the host is the key lookup, the allocations and the kernel launches.

An op's CUDA impl asks `Plans.lookup(tensors, scalars)` first. A miss checks the inputs in full, lets the kernels
decide everything the signature fixes (kernel choice, tiling, splits, launch arguments: kernels/dispatch.py
`decode_plan`) and keeps the plan; a hit runs it with no check, no choice and no argument building. The check
is skipped on a hit because the key holds everything a metadata check reads (dtype, device, shape and strides of
every tensor; each scalar's type and value: `_checks.once_per_signature`'s signature) and more:
  * each tensor's 16-byte alignment (Triton specializes on it: a plan's launches replay its first call's kernels);
  * the current CUDA device (whose stream the launches go to), the tuning in effect (mla_compile/tuning.py) and
    the environment variables the choices read (the decode backend, PDL).
No plan is kept where a call must be checked each time: a CPU tensor (the data checks read its values), a tensor
of another kind (a FakeTensor or subclass), or data checks switched on (MLA_COMPILE_CHECK_DATA=1).

H200 host (benchmarks/host_overhead.py): see benchmarks/RESULTS.md "Host time per eager call of every op".
"""

from __future__ import annotations

import os

import torch

from .. import tuning
from . import _checks as C

# the environment a plan's choices read when it is made: a change makes new plans
_ENV = (tuning.DECODE_KERNEL_ENV, tuning.PDL_ENV, C.DATA_ENV)  # data checks last
# os.environ.get decodes and re-encodes per call (~1.7 us each on the H200 host): the switches are read from its
# encoded table instead (what os.environ itself keeps current on every write); elsewhere, through os.environ
_TABLE = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
if _TABLE is not None and _ENCODE is not None:
    _KEYS = tuple(_ENCODE(name) for name in _ENV)
    _DATA_ON = os.environ.encodevalue("1")

    def _switches() -> tuple:
        return tuple([_TABLE.get(k) for k in _KEYS])
else:  # pragma: no cover - a Python without os.environ's encoded table
    _DATA_ON = "1"

    def _switches() -> tuple:
        return tuple([os.environ.get(name) for name in _ENV])


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # model weights reach the linear ops as Parameters
_LIMIT = 4096  # plans kept per op (a serving process sees a handful of signatures; a stream of new ones starts over)


class Plans:
    """One op's plans, keyed by call signature."""

    def __init__(self):
        self._plans: dict = {}

    def lookup(self, tensors: tuple, scalars: tuple):
        """(key, plan): plan None on a miss; key None where no plan may be kept (see the module docstring)."""
        key = []
        for t in tensors:
            if t is None:
                key.append(None)
            elif type(t) in _PLAIN and t.get_device() >= 0:  # a CUDA tensor (get_device: -1 on the CPU)
                key += (t.dtype, t.get_device(), t.shape, t.stride(), t.data_ptr() & 15)
            else:
                return None, None
        env = _switches()
        if env[-1] == _DATA_ON:  # data checks on: every call checked
            return None, None
        for a in scalars:
            key += (type(a), a)
        key += (torch._C._cuda_getDevice(), tuning.current(), env)
        key = tuple(key)
        return key, self._plans.get(key)

    def run(self, tensors: tuple, scalars: tuple, check, make):
        """`plan(*tensors)` with this signature's plan; on a miss `check()` first, then `make()` -> (plan, keep)
        (keep False: a plan for this call only)."""
        key, plan = self.lookup(tensors, scalars)
        if plan is None:
            check()
            plan, keep = make()
            if keep:
                self.keep(key, plan)
        return plan(*tensors)

    def keep(self, key, plan) -> None:
        if key is None:
            return
        if len(self._plans) >= _LIMIT:
            self._plans.clear()
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()
