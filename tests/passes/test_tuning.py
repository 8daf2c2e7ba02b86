"""mla_compile/tuning.py: the one configuration surface. Values are checked, `use` nests and restores, `bind`
runs a function under a Tuning, `from_options` splits a backend's options, and the graph rewrites honour the
fields they read (the decode-kernel field: tests/kernels/test_kernel_policy.py)."""

from __future__ import annotations

import threading

import pytest
import torch

from mla_compile import tuning
from mla_compile.passes import fused_linear
from mla_compile.passes.split_argmax import COUNTER, split_arg_reductions

COUNTERS = torch._dynamo.utils.counters


@pytest.mark.parametrize("field,bad", [("decode_kernel", "fast"), ("absorb", "einsum"), ("lone_linear_min_k", -1),
                                       ("lone_linear_max_n", 2.5), ("split_argmax_max_rows", True)])
def test_bad_values_are_value_errors_naming_the_field(field, bad):
    with pytest.raises(ValueError, match=field):
        tuning.Tuning(**{field: bad})
    with pytest.raises(ValueError, match=f"options: {field}"):
        tuning.from_options({field: bad})


def test_defaults_are_the_measured_choices_and_frozen():
    t = tuning.Tuning()
    assert (t.decode_kernel, t.absorb, t.lone_linear_min_k, t.lone_linear_max_n, t.split_argmax_max_rows) == (
        "auto", "auto", 1024, 8192, 256)
    with pytest.raises(AttributeError):
        t.absorb = "bmm"
    assert tuning.FIELDS == tuple(vars(t))  # every field is an options key


def test_use_nests_restores_and_stays_in_its_thread():
    a, b = tuning.Tuning(absorb="bmm"), tuning.Tuning(split_argmax_max_rows=0)
    seen = []
    with tuning.use(a):
        with tuning.use(b):
            assert tuning.current() is b
            t = threading.Thread(target=lambda: seen.append(tuning.current()))
            t.start()
            t.join()
        assert tuning.current() is a
        with pytest.raises(RuntimeError), tuning.use(b):
            raise RuntimeError
        assert tuning.current() is a
    assert tuning.current() == tuning.DEFAULT and seen == [tuning.DEFAULT]
    with pytest.raises(TypeError, match="tuning"):
        with tuning.use({"absorb": "bmm"}):
            pass


def test_the_fused_linear_pass_reads_its_lone_linear_limits():
    w = torch.empty(4096, 2048)  # q_b_proj-like
    assert fused_linear._lone_worth_it(w)
    with tuning.use(tuning.Tuning(lone_linear_min_k=8192)):
        assert not fused_linear._lone_worth_it(w)
    with tuning.use(tuning.Tuning(lone_linear_max_n=4095)):
        assert not fused_linear._lone_worth_it(w)
    assert not fused_linear._lone_worth_it(torch.empty(32768, 2048))  # lm_head
    with tuning.use(tuning.Tuning(lone_linear_max_n=1 << 30)):
        assert fused_linear._lone_worth_it(torch.empty(32768, 2048))


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("max_rows,count", [(256, 1), (7, 0)])
def test_the_split_argmax_pass_reads_its_row_limit(max_rows, count):
    def greedy(logits):
        return logits.argmax(-1)

    def backend(gm, example_inputs):
        with tuning.use(tuning.Tuning(split_argmax_max_rows=max_rows)):
            split_arg_reductions(gm)
        return gm.forward

    logits = torch.randn(8, 32768)
    out = torch.compile(greedy, backend=backend, fullgraph=True)(logits)
    assert torch.equal(out, greedy(logits))
    assert COUNTERS["mla_compile"][COUNTER] == count
