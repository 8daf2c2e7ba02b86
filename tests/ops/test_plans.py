"""ops/_plans.py without a GPU: what enters a plan's key, where no plan may be kept, and that a plan is made once
per signature and checked only then. (tests/gpu/test_op_plans_cuda.py replays real plans on the GPU.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
import torch

from mla_compile import tuning
from mla_compile.ops import _checks as C
from mla_compile.ops import _plans


def test_the_switches_follow_the_environment(monkeypatch):
    """A plan's choices read MLA_COMPILE_DECODE_BACKEND / MLA_COMPILE_PDL / MLA_COMPILE_GLUON_PDL: a change must
    change the key."""
    for name in (tuning.DECODE_KERNEL_ENV, tuning.PDL_ENV, tuning.GLUON_PDL_ENV, C.DATA_ENV):
        monkeypatch.delenv(name, raising=False)
    before = _plans._switches()
    monkeypatch.setenv(tuning.DECODE_KERNEL_ENV, "triton")
    with_backend = _plans._switches()
    monkeypatch.setenv(tuning.PDL_ENV, "0")
    with_pdl = _plans._switches()
    monkeypatch.setenv(tuning.GLUON_PDL_ENV, "0")
    with_gluon_pdl = _plans._switches()
    assert len({before, with_backend, with_pdl, with_gluon_pdl}) == 4
    monkeypatch.setenv(C.DATA_ENV, "1")
    assert _plans._switches()[-1] == _plans._DATA_ON
    for name in (tuning.DECODE_KERNEL_ENV, tuning.PDL_ENV, tuning.GLUON_PDL_ENV, C.DATA_ENV):
        monkeypatch.delenv(name)
    assert _plans._switches() == before


def test_cpu_tensors_keep_no_plan_and_are_checked_every_call():
    plans, checks, made = _plans.Plans(), [], []

    def run(x):
        return plans.run((x,), (1.0,), lambda: checks.append(1), lambda: (made.append(1) or (lambda x: x + 1), True))

    x = torch.zeros(3)
    assert torch.equal(run(x), x + 1) and torch.equal(run(x), x + 1)
    assert checks == [1, 1] and made == [1, 1] and not plans._plans
    assert plans.lookup((torch.nn.Parameter(torch.zeros(2)),), ()) == (None, None)  # a CPU Parameter: none either


@pytest.mark.skipif(not torch.cuda.is_available(), reason="keys of CUDA tensors")
def test_a_cuda_plan_is_made_and_checked_once_per_signature(monkeypatch):
    monkeypatch.delenv(C.DATA_ENV, raising=False)
    plans, checks = _plans.Plans(), []

    def run(x, s=1.0):
        return plans.run((x,), (s,), lambda: checks.append(1), lambda: ((lambda x: x * 2), True))

    x = torch.ones(4, device="cuda")
    run(x), run(torch.zeros(4, device="cuda")), run(x, 2.0), run(x[1:])  # same, same, scalar, offset + shape
    assert len(checks) == 3 and len(plans._plans) == 3
    monkeypatch.setenv(C.DATA_ENV, "1")
    run(x)
    assert len(checks) == 4 and len(plans._plans) == 3  # data checks on: checked, not kept


def test_a_decode_plan_sizes_its_merge_for_the_call_device(monkeypatch):
    """AttendPlan takes the partials' strides from meta tensors; the merge launch's SM count and PDL switch (and the
    self-merging launch's merge tiling, `merge_work`) must still come from the call's device (a meta device reads as
    "not a GPU": 4 SMs, no PDL)."""
    from mla_compile.kernels import decode as D
    from mla_compile.kernels import merge as M

    seen = []
    monkeypatch.setattr(M, "sm_count", lambda device: seen.append(device) or 4)
    monkeypatch.setattr(M, "pdl_launch", lambda device: seen.append(device) or {})
    qn, qp = torch.randn(2, 16, 512, dtype=torch.bfloat16), torch.randn(2, 16, 64, dtype=torch.bfloat16)
    ckv, kpe = torch.randn(4, 64, 512, dtype=torch.bfloat16), torch.randn(4, 64, 64, dtype=torch.bfloat16)
    table, lens = torch.arange(4, dtype=torch.int32).view(2, 2), torch.full((2,), 100, dtype=torch.int32)
    plan = D.decode_plan(qn, qp, ckv, kpe, table, lens, 0.1, splits=3)
    assert plan.ns == 3 and len(seen) == 3 and all(d == qn.device for d in seen)


# ================================================================================ recent signatures (C++ check)
def test_this_torch_has_the_cpp_tensor_check():
    """The fast path is on for the torch versions we pin (2.11-2.15); `_guards_work` turns it off (the key alone)
    where a torch's private TensorGuards changed."""
    assert _plans._GUARDS


_DTYPES = (torch.float32, torch.bfloat16, torch.int32)
_SCALARS = (0.1, 1, 1.0, True, None)


@st.composite
def _arg(draw):
    """An optional tensor: dtype, shape, strides (a transpose), a 4-byte offset (misaligned), a Parameter."""
    if draw(st.integers(0, 5)) == 0:
        return None
    shape = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    dtype = draw(st.sampled_from(_DTYPES))
    base = torch.zeros(64 + 2 * torch.Size(shape).numel(), dtype=torch.int32).view(dtype)
    t = base[draw(st.sampled_from((0, 4 // base.element_size()))):][:torch.Size(shape).numel()].view(shape)
    if len(shape) == 2 and draw(st.booleans()):
        t = t.t()
    if dtype != torch.int32 and draw(st.integers(0, 3)) == 0:
        t = torch.nn.Parameter(t)
    return t


def _key(tensors, scalars):
    return (tuple(None if t is None else (type(t), t.dtype, t.device, t.shape, t.stride(), t.data_ptr() & 15,
                                          t.requires_grad) for t in tensors),
            tuple((type(a), a) for a in scalars))


@settings(max_examples=300, deadline=None)
@given(a=st.lists(_arg(), min_size=1, max_size=4), b=st.lists(_arg(), min_size=1, max_size=4),
       sa=st.lists(st.sampled_from(_SCALARS), max_size=2), sb=st.lists(st.sampled_from(_SCALARS), max_size=2),
       same_tensors=st.booleans())
def test_a_recent_signature_matches_exactly_when_the_key_would(a, b, sa, sb, same_tensors):
    """What `Plans.run` asks before the key: a recent signature's plan is found for a call iff the call's key
    (with requires_grad, which the C++ check also reads) equals the signature's, and the call is aligned."""
    if same_tensors:  # equal signatures: fresh tensors of the same layout
        b = [None if t is None else type(t)(t.detach().clone().as_strided(t.shape, t.stride())) if isinstance(
            t, torch.nn.Parameter) else t.clone().as_strided(t.shape, t.stride()) for t in a]
    a, b, sa, sb = tuple(a), tuple(b), tuple(sa), tuple(sb)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_plans, "_state", lambda: ("device", "tuning", _plans._switches()))
        plans = _plans.Plans()
        if not _plans._aligned(a):  # run keeps no recent entry for a misaligned call
            return
        plans._recent = (_plans._Recent(a, sa, _plans._state(), lambda *ts: "recent"),)
        found = plans._recent_plan(b, sb)
        # run's own (written-out) copy of the test gives the same answer; a miss reaches the key
        mp.setattr(plans, "lookup", lambda tensors, scalars: (None, lambda *ts: "key"))
        ran = plans.run(b, sb, None, None)
    expected = _key(a, sa) == _key(b, sb) and _plans._aligned(b)
    assert (found is not None) == expected and ran == ("recent" if expected else "key")


def test_a_recent_signature_needs_the_same_state(monkeypatch):
    """Another device, tuning or environment switch: not the recent plan (the key decides, and makes a new one)."""
    x = torch.zeros(4)
    states = iter([("dev0", "t", ("e",)), ("dev1", "t", ("e",))])
    monkeypatch.setattr(_plans, "_state", lambda: next(states))
    plans = _plans.Plans()
    plans._recent = (_plans._Recent((x,), (), _plans._state(), "plan"),)
    assert plans._recent_plan((torch.ones(4),), ()) is None


def test_recent_signatures_are_kept_first_in_first_out_and_cleared(monkeypatch):
    monkeypatch.setattr(_plans, "_state", lambda: ("device", "tuning", _plans._switches()))
    monkeypatch.setattr(_plans.Plans, "lookup", lambda self, tensors, scalars: (("key", tensors[0].shape), None))
    plans, made = _plans.Plans(), []

    def run(n):
        return plans.run((torch.zeros(n),), (), lambda: None, lambda: (made.append(n) or (lambda x: n), True))

    for n in range(1, _plans._RECENT + 3):
        assert run(n) == n
    assert [r.plan(None) for r in plans._recent] == list(range(3, _plans._RECENT + 3))
    assert run(_plans._RECENT + 2) == _plans._RECENT + 2 and len(made) == _plans._RECENT + 2  # a recent hit
    plans.clear()
    assert plans._recent == () and not plans._plans


def test_one_tensor_passed_twice_takes_the_key(monkeypatch):
    """The C++ check rejects a tensor object passed in two places (Dynamo's duplicate-input rule): such a call misses
    the recent signature and takes the key, which finds the same plan (slower, never another plan)."""
    monkeypatch.setattr(_plans, "_state", lambda: ("device", "tuning", _plans._switches()))
    x = torch.zeros(4)
    plans = _plans.Plans()
    state = _plans._state()
    plans._recent = (_plans._Recent((torch.zeros(4), torch.zeros(4)), (), state, "plan"),)
    assert plans._recent_plan((x, x), ()) is None and plans._recent_plan((x, torch.zeros(4)), ()) == "plan"


def test_a_plan_the_key_finds_returns_to_a_free_recent_place(monkeypatch):
    """After the recent signatures are dropped (or with places free), a plan the key finds is checked the fast way
    from its next call on; with every place taken, only new plans evict (no guard built per call)."""
    monkeypatch.setattr(_plans, "_state", lambda: ("device", "tuning", _plans._switches()))
    keys = []
    plans = _plans.Plans()
    monkeypatch.setattr(plans, "lookup", lambda tensors, scalars: (keys.append(1) or ("k", tensors[0].shape),
                                                                    plans._plans.get(("k", tensors[0].shape))))

    def run(n):
        return plans.run((torch.zeros(n),), (), lambda: None, lambda: ((lambda x: n), True))

    run(3)
    plans._recent = ()  # dropped, the plan still kept
    run(3), run(3), run(3)
    assert len(keys) == 2 and len(plans._recent) == 1  # the key once more, then the recent check
    for n in range(4, 4 + _plans._RECENT):
        run(n)
    full = plans._recent
    plans._plans[("k", torch.Size([3]))] = lambda x: 3
    assert run(3) == 3 and plans._recent is full  # found by the key, every place taken: nothing evicted


def test_more_tensors_than_absent_places_take_the_key(monkeypatch):
    """A call of more tensors than the recent check takes (`_MAX_GUARDED`, e.g. a fused linear of many weights) keeps
    no recent signature: every call takes the key, none fails."""
    monkeypatch.setattr(_plans, "_state", lambda: ("device", "tuning", _plans._switches()))
    n = _plans._MAX_GUARDED + 2
    monkeypatch.setattr(_plans.Plans, "lookup", lambda self, tensors, scalars: (("k", len(tensors)),
                                                                               self._plans.get(("k", len(tensors)))))
    plans = _plans.Plans()
    run = lambda *ts: plans.run(ts, (), lambda: None, lambda: ((lambda *x: len(x)), True))  # noqa: E731
    assert run(*[torch.zeros(1) for _ in range(3)]) == 3
    assert run(*[torch.zeros(1) for _ in range(n)]) == n and run(*[torch.zeros(1) for _ in range(n)]) == n
    assert all(r.n == 3 for r in plans._recent)
