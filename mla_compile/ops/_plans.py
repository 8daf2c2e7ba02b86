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

Before the key, `run` tries the signatures it kept last (`_Recent`, up to 8 an op): one call of Dynamo's C++ tensor
check (`TensorGuards`: type, dtype, device, shape, strides, requires_grad, dispatch keys of every tensor) plus the
alignment, the scalars and the state. On the H200 host the key costs ~16 us for decode's seven tensors (`get_device`,
`data_ptr`, shapes and strides read one attribute at a time, then a tuple hashed); the check ~1 us on a laptop core.
Where this torch's `TensorGuards` is missing or checks less than the key would (`_guards_work`), only the key is used.

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
_RECENT = 8  # signatures checked before the key: a decoder layer calls each op with a few (the linears: one a weight)
# an absent optional tensor in a guard, one per argument position (the check rejects one tensor passed twice, as
# Dynamo's duplicate-input guard does): no call's tensor matches them
_ABSENT = tuple(torch.empty((), device="meta") for _ in range(16))


def _present(tensors: tuple) -> list:
    return [a if t is None else t for t, a in zip(tensors, _ABSENT)]


def _make_guard(tensors: list):
    return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                         dynamic_dims_strides=[list(t.stride()) for t in tensors])


def _guards_work() -> bool:
    """Whether this torch has Dynamo's TensorGuards with the constructor used here, and its check rejects every
    difference the key would see (a private API: checked once, at import, on CPU tensors)."""
    try:
        a = torch.zeros(2, 3)
        guard = _make_guard(_present((a, None)))
        same = guard.check(*_present((torch.ones(2, 3), None)))
        different = (
            (a.t().contiguous().t(), None),  # strides
            (torch.zeros(3, 2), None),  # shape
            (a.double(), None),  # dtype
            (torch.nn.Parameter(a), None),  # type
            (a.clone().requires_grad_(), None),  # requires_grad
            (a, a.new_zeros(())),  # a tensor where the signature had none
            (a.to("meta"), None),  # device
        )
        return same and not any(guard.check(*_present(args)) for args in different)
    except Exception:  # noqa: BLE001 - any failure of a private API: the key alone
        return False


try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a torch without Dynamo's C++ guards
    _TensorGuards = None
_GUARDS = _TensorGuards is not None and _guards_work()


def _state(env: tuple) -> tuple:
    """What a plan's choices read besides the call's arguments: the current device, the tuning, the switches."""
    return torch._C._cuda_getDevice(), tuning.current(), env


class _Recent:
    """A kept plan's signature as one C++ check reads it (`Plans.run`); all its tensors 16-byte aligned."""

    __slots__ = ("guard", "n", "scalars", "types", "state", "plan")

    def __init__(self, tensors: tuple, scalars: tuple, state: tuple, plan):
        self.guard, self.n = _make_guard(_present(tensors)), len(tensors)
        self.scalars, self.types, self.state, self.plan = scalars, tuple(map(type, scalars)), state, plan


def _aligned(tensors: tuple) -> bool:
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    return bits & 15 == 0


def dispatch_module():
    """kernels/dispatch.py (it imports Triton), imported where a plan is made: a planned call imports nothing (an
    import statement in a function costs ~1 us a call on a laptop core, ~5 us on the H200 host)."""
    from ..kernels import dispatch as module

    return module


class Plans:
    """One op's plans, keyed by call signature."""

    def __init__(self):
        self._plans: dict = {}
        self._recent: tuple = ()  # _Recent entries, oldest first (a tuple: replaced whole, never changed in place)

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
        if self._recent:
            plan = self._recent_plan(tensors, scalars)
            if plan is not None:
                return plan(*tensors)
        key, plan = self.lookup(tensors, scalars)
        if plan is None:
            check()
            plan, keep = make()
            if keep and key is not None:
                self.keep(key, plan)
                self._remember(tensors, scalars, plan)
        elif len(self._recent) < _RECENT:
            # a kept plan the key found fills a free place only (e.g. after a clear): with more signatures than
            # places in turn, evicting here would build a guard every call
            self._remember(tensors, scalars, plan)
        return plan(*tensors)

    def _remember(self, tensors: tuple, scalars: tuple, plan) -> None:
        """This signature among the recent ones, in the oldest one's place when all are taken."""
        if _GUARDS and len(tensors) <= len(_ABSENT) and _aligned(tensors):
            self._recent = (*self._recent[1 - _RECENT:], _Recent(tensors, scalars, _state(_switches()), plan))

    def _recent_plan(self, tensors: tuple, scalars: tuple):
        """The plan of a recent signature these arguments have (None: none has them). Equal to the key's answer:
        the guard reads every tensor's type, dtype, device, shape and strides, each recent signature's tensors are
        aligned as these must be, and the scalars (values and types) and the state must be equal."""
        present, n = _present(tensors), len(tensors)
        state = None
        for r in self._recent:
            if r.n == n and r.scalars == scalars and r.guard.check(*present):
                state = state or _state(_switches())
                if r.state == state and _aligned(tensors) and r.types == tuple(map(type, scalars)):
                    return r.plan
        return None

    def keep(self, key, plan) -> None:
        if key is None:
            return
        if len(self._plans) >= _LIMIT:
            self.clear()
        self._plans[key] = plan

    def clear(self) -> None:
        self._plans.clear()
        self._recent = ()
