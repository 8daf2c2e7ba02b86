"""Per-signature call plans for the ops' CUDA impls: what an eager call (or a default-mode compiled graph, which
calls the op the same way) pays on the host is the key lookup, the allocations and the kernel launches.

An op's CUDA impl asks `Plans.lookup(tensors, scalars)` first. A miss checks the inputs in full, lets the kernels
decide everything the signature fixes (kernel choice, tiling, splits, launch arguments: kernels/dispatch.py
`decode_plan`) and keeps the plan; a hit runs it with no check, no choice and no argument building. The check
is skipped on a hit because the key holds everything a metadata check reads (dtype, device, shape and strides of
every tensor; each scalar's type and value: `_checks.once_per_signature`'s signature) and more:
  * each tensor's 16-byte alignment (Triton specializes on it: a plan's launches replay its first call's kernels);
  * the current CUDA device (whose stream the launches go to), the tuning in effect (mla_compile/tuning.py) and
    the environment variables the choices read (the decode backend, PDL, the swap-AB TOKENS form).
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

import operator
import os

import torch

from .. import tuning
from . import _checks as C

# the environment a plan's choices read when it is made: a change makes new plans
_ENV = (tuning.DECODE_KERNEL_ENV, tuning.PDL_ENV, tuning.GLUON_PDL_ENV, tuning.SWAPAB_TOKENS_ENV,
        C.DATA_ENV)  # data checks last
# os.environ.get decodes and re-encodes per call (~1.7 us each on the H200 host): the switches are read from its
# encoded table instead (what os.environ itself keeps current on every write); elsewhere, through os.environ
_TABLE = getattr(os.environ, "_data", None)
_ENCODE = getattr(os.environ, "encodekey", None)
if _TABLE is not None and _ENCODE is not None:
    _KEYS = tuple(_ENCODE(name) for name in _ENV)
    _DATA_ON = os.environ.encodevalue("1")

    def _switches() -> tuple:
        return tuple(map(_TABLE.get, _KEYS))
else:  # pragma: no cover - a Python without os.environ's encoded table
    _DATA_ON = "1"

    def _switches() -> tuple:
        return tuple([os.environ.get(name) for name in _ENV])


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # model weights reach the linear ops as Parameters
_LIMIT = 4096  # plans kept per op (a serving process sees a handful of signatures; a stream of new ones starts over)
_RECENT = 8  # signatures checked before the key: a decoder layer calls each op with a few (the linears: one a weight)
_MAX_GUARDED = 16  # tensors of a signature the recent check takes (more: the key alone)


def _make_guard(tensors: list):
    return _TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                         dynamic_dims_strides=[list(t.stride()) for t in tensors])


def _guards_work() -> bool:
    """Whether this torch has Dynamo's TensorGuards with the constructor used here, and its check rejects every
    difference the key would see (a private API: checked once, at import, on CPU tensors)."""
    try:
        a = torch.zeros(2, 3)
        guard = _make_guard([a])
        same = guard.check(torch.ones(2, 3))
        different = (
            a.t().contiguous().t(),  # strides
            torch.zeros(3, 2),  # shape
            a.double(),  # dtype
            torch.nn.Parameter(a),  # type
            a.clone().requires_grad_(),  # requires_grad
            a.to("meta"),  # device
            None,  # no tensor where the signature had one
        )
        return same and not any(guard.check(t) for t in different)
    except Exception:  # noqa: BLE001 - any failure of a private API: the key alone
        return False


try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:  # pragma: no cover - a torch without Dynamo's C++ guards
    _TensorGuards = None
_GUARDS = _TensorGuards is not None and _guards_work()


# the current CUDA device's index without torch.cuda's Python (a CPU-only torch has no CUDA device: -1), and the
# tuning in effect as `tuning.current` reads it, without its frame
_device_index = getattr(torch._C, "_cuda_getDevice", None) or (lambda: -1)
_current_tuning = tuning._current.get

if _TABLE is not None and _ENCODE is not None:
    _table_get = _TABLE.get

    def _state() -> tuple:
        """What a plan's choices read besides the call's arguments: the current device, the tuning, the switches
        (`_switches` written out: every planned call asks)."""
        return _device_index(), _current_tuning(), tuple(map(_table_get, _KEYS))
else:  # pragma: no cover - a Python without os.environ's encoded table
    def _state() -> tuple:
        """What a plan's choices read besides the call's arguments: the current device, the tuning, the switches."""
        return _device_index(), _current_tuning(), _switches()


def _items(positions: tuple):
    """A C-level getter of `positions` of a tuple, always returning a tuple (itemgetter of one returns the item)."""
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions) if positions else (lambda args: ())


class _Recent:
    """A kept plan's signature as one C++ check reads it (`Plans.run`): a guard over its tensors (the absent optional
    ones, None, stand apart: `take` picks the present ones, `nones` the places that must hold None); all 16-byte
    aligned."""

    __slots__ = ("guard", "n", "take", "nones", "absent", "scalars", "types", "state", "plan")

    def __init__(self, tensors: tuple, scalars: tuple, state: tuple, plan):
        present = tuple(i for i, t in enumerate(tensors) if t is not None)
        absent = tuple(i for i, t in enumerate(tensors) if t is None)
        self.take, self.nones, self.absent = _items(present), _items(absent), (None,) * len(absent)
        self.guard, self.n = _make_guard(list(self.take(tensors))), len(tensors)
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


def dispatch_plan(name: str):
    """A plan maker for `Plans.run`: `make(*args)` -> kernels/dispatch.py's `name(*args)`, imported on the first miss."""
    return lambda *args: getattr(dispatch_module(), name)(*args)


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
        key += (_device_index(), _current_tuning(), env)
        key = tuple(key)
        return key, self._plans.get(key)

    def run(self, tensors: tuple, scalars: tuple, check, make, args: tuple = ()):
        """`plan(*tensors)` with this signature's plan; on a miss `check(*args)` first, then `make(*args)` ->
        (plan, keep) (keep False: a plan for this call only). The recent signatures' check is written out here, not
        called (`_recent_plan` is the same test): every eager call of every op pays this path."""
        n = len(tensors)
        state = None
        for r in self._recent:
            if r.n == n and r.scalars == scalars:
                present = r.take(tensors)
                if r.nones(tensors) == r.absent and r.guard.check(*present):
                    bits = 0
                    for t in present:
                        bits |= t.data_ptr()
                    state = state or _state()
                    if bits & 15 == 0 and r.state == state and r.types == tuple(map(type, scalars)):
                        return r.plan(*tensors)
        key, plan = self.lookup(tensors, scalars)
        if plan is None:
            check(*args)
            plan, keep = make(*args)
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
        if _GUARDS and len(tensors) <= _MAX_GUARDED and _aligned(tensors):
            self._recent = (*self._recent[1 - _RECENT:], _Recent(tensors, scalars, _state(), plan))

    def _recent_plan(self, tensors: tuple, scalars: tuple):
        """The plan of a recent signature these arguments have (None: none has them); `run` inlines this test.
        Equal to the key's answer: the guard reads every present tensor's type, dtype, device, shape and strides, the
        absent ones must be absent, each recent signature's tensors are aligned as these must be, and the scalars
        (values and types) and the state must be equal."""
        n = len(tensors)
        for r in self._recent:
            if r.n == n and r.scalars == scalars:
                present = r.take(tensors)
                if (r.nones(tensors) == r.absent and r.guard.check(*present) and _aligned(present)
                        and r.state == _state() and r.types == tuple(map(type, scalars))):
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
