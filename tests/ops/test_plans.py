"""ops/_plans.py without a GPU: what enters a plan's key, where no plan may be kept, and that a plan is made once
per signature and checked only then. (tests/gpu/test_op_plans_cuda.py replays real plans on the GPU.)"""

from __future__ import annotations

import pytest
import torch

from mla_compile import tuning
from mla_compile.ops import _checks as C
from mla_compile.ops import _plans


def test_the_switches_follow_the_environment(monkeypatch):
    """A plan's choices read MLA_COMPILE_DECODE_BACKEND / MLA_COMPILE_PDL: a change must change the key."""
    monkeypatch.delenv(tuning.DECODE_KERNEL_ENV, raising=False)
    monkeypatch.delenv(tuning.PDL_ENV, raising=False)
    monkeypatch.delenv(C.DATA_ENV, raising=False)
    before = _plans._switches()
    monkeypatch.setenv(tuning.DECODE_KERNEL_ENV, "triton")
    with_backend = _plans._switches()
    monkeypatch.setenv(tuning.PDL_ENV, "0")
    with_pdl = _plans._switches()
    assert len({before, with_backend, with_pdl}) == 3
    monkeypatch.setenv(C.DATA_ENV, "1")
    assert _plans._switches()[-1] == _plans._DATA_ON
    monkeypatch.delenv(tuning.DECODE_KERNEL_ENV)
    monkeypatch.delenv(tuning.PDL_ENV)
    monkeypatch.delenv(C.DATA_ENV)
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
    """AttendPlan takes the partials' strides from meta tensors; the merge launch's SM count and PDL switch must
    still come from the call's device (a meta device reads as "not a GPU": 4 SMs, no PDL)."""
    from mla_compile.kernels import decode as D
    from mla_compile.kernels import merge as M

    seen = []
    monkeypatch.setattr(M, "sm_count", lambda device: seen.append(device) or 4)
    monkeypatch.setattr(M, "pdl_launch", lambda device: seen.append(device) or {})
    qn, qp = torch.randn(2, 16, 512, dtype=torch.bfloat16), torch.randn(2, 16, 64, dtype=torch.bfloat16)
    ckv, kpe = torch.randn(4, 64, 512, dtype=torch.bfloat16), torch.randn(4, 64, 64, dtype=torch.bfloat16)
    table, lens = torch.arange(4, dtype=torch.int32).view(2, 2), torch.full((2,), 100, dtype=torch.int32)
    plan = D.decode_plan(qn, qp, ckv, kpe, table, lens, 0.1, splits=3)
    assert plan.ns == 3 and len(seen) == 2 and all(d == qn.device for d in seen)
