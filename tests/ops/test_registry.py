"""How ops are registered (mla_compile/ops/_registry.py) and how their checks are skipped for a repeated signature
(`_checks.once_per_signature`): behaviour a custom_op user relies on stays, and no bad call slips through."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from mla_compile.ops import _checks as C
from mla_compile.ops._registry import define


# ------------------------------------------------------------------------------------------------ registry
@define("registry_test::scale_into", schema="(Tensor(a!) out, Tensor x, float s) -> ()", mutates_args=("out",))
def scale_into(out, x, s):
    """out = x * s, in place."""
    out.copy_(x * s)


@scale_into.register_fake
def _(out, x, s):
    return None


@define("registry_test::double", schema="(Tensor x) -> Tensor")
def double(x):
    return x * 2


@double.register_fake
def _(x):
    return torch.empty_like(x)


double.register_autograd(lambda ctx, g: 2 * g)


def test_an_in_place_op_bumps_the_version_of_what_it_writes():
    out, x = torch.zeros(3), torch.ones(3)
    before = out._version
    scale_into(out, x, 3.0)
    assert torch.equal(out, torch.full((3,), 3.0))
    assert out._version > before and x._version == 0


def test_autograd_sees_a_saved_tensor_overwritten_by_an_in_place_op():
    w = torch.ones(3, requires_grad=True)
    buf = torch.zeros(3)
    y = (w * buf).sum()  # saves buf for the backward
    scale_into(buf, torch.ones(3), 2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


def test_the_op_keeps_its_function_name_doc_and_autograd():
    assert scale_into.__doc__ == "out = x * s, in place." and scale_into.__name__ == "scale_into"
    assert torch.Tag.pt2_compliant_tag in torch.ops.registry_test.double.default.tags
    x = torch.randn(4, requires_grad=True)
    double(x).sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.0))
    torch.library.opcheck(torch.ops.registry_test.double.default, (torch.randn(3, requires_grad=True),))


def test_the_op_compiles_in_one_graph():
    f = torch.compile(lambda x: double(x) + 1, backend="aot_eager", fullgraph=True)
    x = torch.randn(5)
    assert torch.equal(f(x), x * 2 + 1)


def test_mutates_args_must_match_the_schema():
    with pytest.raises(ValueError, match="mutates_args"):
        define("registry_test::liar", schema="(Tensor(a!) out, Tensor x) -> ()", mutates_args=())(lambda out, x: None)


# ---------------------------------------------------------------------------------------- once_per_signature
class Counted:
    """A check that counts its runs and refuses a float64 first argument."""

    def __init__(self):
        self.runs = 0
        self.check = C.once_per_signature(self._check)

    def _check(self, t, n=1):
        self.runs += 1
        C.check(t.dtype != torch.float64, "t", "float64 refused")
        return t.shape[0] * n


def test_a_repeated_signature_is_checked_once():
    c = Counted()
    t = torch.empty(4, 2, device="meta")
    assert c.check(t, 3) == 12 and c.check(t, 3) == 12 and c.check(torch.empty(4, 2, device="meta"), 3) == 12
    assert c.runs == 1


@pytest.mark.parametrize("other", [
    lambda: (torch.empty(5, 2, device="meta"), 3),  # shape
    lambda: (torch.empty(4, 2, device="meta").t().contiguous().t(), 3),  # strides
    lambda: (torch.empty(4, 2, dtype=torch.float16, device="meta"), 3),  # dtype
    lambda: (torch.empty(4, 2, device="meta"), 4),  # scalar
    lambda: (torch.empty(4, 2, device="meta"), True),  # a bool is no int to a check
], ids=["shape", "strides", "dtype", "scalar", "scalar-type"])
def test_anything_a_check_reads_differs_and_it_runs_again(other):
    c = Counted()
    c.check(torch.empty(4, 2, device="meta"), 3)
    c.check(*other())
    assert c.runs == 2


def test_keyword_arguments_reach_the_check_and_its_signature():
    c = Counted()
    t = torch.empty(4, 2, device="meta")
    assert c.check(t, n=3) == 12 and c.check(t, n=3) == 12 and c.check(t, n=5) == 20
    assert c.runs == 2


def test_parameters_count_as_plain_tensors():
    c = Counted()
    w = torch.nn.Parameter(torch.empty(4, 2, device="meta"))
    c.check(w, 3), c.check(w, 3)
    assert c.runs == 1


def test_a_refused_call_raises_every_time():
    c = Counted()
    bad = torch.empty(4, device="meta", dtype=torch.float64)
    for _ in range(3):
        with pytest.raises(ValueError, match="t: float64 refused"):
            c.check(bad)
    assert c.runs == 3


def test_cpu_tensors_fake_tensors_and_data_checks_always_run_the_check(monkeypatch):
    c = Counted()
    cpu = torch.empty(4)
    c.check(cpu), c.check(cpu)  # data checks read CPU values
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.empty(4))
        c.check(fake), c.check(fake)
    assert c.runs == 4
    meta = torch.empty(4, device="meta")
    monkeypatch.setenv(C.DATA_ENV, "1")
    c.check(meta), c.check(meta)
    assert c.runs == 6


def test_a_real_op_refuses_a_bad_call_after_a_good_one_of_the_same_shapes():
    m = dict(device="meta")
    q = torch.empty(2, 16, 512, dtype=torch.bfloat16, **m)
    qp = torch.empty(2, 16, 64, dtype=torch.bfloat16, **m)
    ckv = torch.empty(8, 64, 512, dtype=torch.bfloat16, **m)
    kpe = torch.empty(8, 64, 64, dtype=torch.bfloat16, **m)
    table = torch.empty(2, 4, dtype=torch.int32, **m)
    lens = torch.empty(2, dtype=torch.int32, **m)
    torch.ops.mla.decode(q, qp, ckv, kpe, table, lens, 0.1)
    torch.ops.mla.decode(q, qp, ckv, kpe, table, lens, 0.1)
    with pytest.raises(ValueError, match="seq_lens"):
        torch.ops.mla.decode(q, qp, ckv, kpe, table, lens.long(), 0.1)
    with pytest.raises(ValueError, match="sm_scale"):
        torch.ops.mla.decode(q, qp, ckv, kpe, table, lens, float("inf"))


# ------------------------------------------------------------------ the no-grad shortcut below autograd
def test_no_grad_calls_reach_the_backend_kernel_directly_but_modes_still_see_the_op():
    """A call where no input requires grad goes from the autograd kernel straight to our kernel for the backend
    below it; anything else that sits between (a TorchDispatchMode, FakeTensors, functionalization) must still see
    the op, and a call that needs grad still builds the graph."""
    x = torch.arange(3.0)
    key = torch._C.DispatchKey.CPU
    direct, kernel = [], double._kernels[key]
    double._kernels[key] = lambda *a: direct.append(1) or kernel(*a)  # seen only where the shortcut is taken
    double._below.clear()  # the shortcut's answers per keyset (register_kernel clears them too)
    try:
        assert torch.equal(double(x), 2 * x) and direct == [1]  # the shortcut: the CPU kernel itself
        _check_modes_see_the_op(x)
        assert direct == [1]  # with a mode (or fake tensors) the dispatcher's redispatch ran instead
    finally:
        double._kernels[key] = kernel
        double._below.clear()
    w = torch.ones(2, requires_grad=True)
    double(w).sum().backward()
    assert torch.equal(w.grad, torch.full((2,), 2.0))
    with torch.no_grad():
        assert double(w).grad_fn is None


def _check_modes_see_the_op(x):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        assert torch.equal(double(x), 2 * x)
    assert "registry_test.double.default" in mode.ops
    with FakeTensorMode():
        fake = double(torch.empty(5))
    assert fake.shape == (5,)
