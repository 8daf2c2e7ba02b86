"""passes/split_argmax.py: argmax / argmin of a few long rows -> two-stage reductions, exactly (ties, NaN, inf).

Snapshot of the rewritten Dynamo graph: `EXPECTTEST_ACCEPT=1 pytest tests/passes/test_split_argmax_pass.py`."""

from __future__ import annotations

import expecttest

from argmax_cases import hard_rows
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_compile.passes.split_argmax import COUNTER, chunk_width, split_arg_reductions
from test_fused_linear_pass import op_lines

COUNTERS = torch._dynamo.utils.counters
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def rewritten(fn, *args, inductor: bool = False):
    """(graph after the pass, fn compiled with it: run as the rewritten FX graph, or by Inductor)."""
    graphs = []

    def backend(gm, example_inputs):
        split_arg_reductions(gm)
        graphs.append(gm)
        if inductor:
            from torch._inductor.compile_fx import compile_fx

            return compile_fx(gm, example_inputs)
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0], out


def greedy(logits):
    return logits[:, -1].argmax(-1, keepdim=True)


class TestSplitArgmaxSnapshot(expecttest.TestCase):
    def test_greedy_pick(self):
        logits = torch.randn(8, 1, 32768)
        gm, out = rewritten(greedy, logits)
        assert torch.equal(out, greedy(logits))
        self.assertEqual(COUNTERS["mla_compile"][COUNTER], 1)
        self.assertExpectedInline(op_lines(gm), """\
%0 = getitem(l_logits_, [slice(None, None, None), -1])
%1 = reshape(%0, [8, 32, 1024])
%2 = argmax(%1, -1)
%3 = amax(%1, -1)
%4 = argmax(%3, -1, True)
%5 = mul(%4, 1024)
%6 = gather(%2, -1, %4)
%7 = add(%5, %6)""")


def test_chunk_width_divides_and_prefers_about_1024():
    assert chunk_width(32768) == 1024
    assert chunk_width(129280) == 1010  # DeepSeek-V3's vocab: 128 x 1010
    assert chunk_width(151936) == 1187  # Qwen's: 128 x 1187
    assert chunk_width(8191) is None  # prime: no chunking
    for n in (8192, 100000, 129280, 151936, 202048):
        c = chunk_width(n)
        assert c is not None and n % c == 0 and 256 <= c <= 4096


@pytest.mark.parametrize("spelling", ["method", "function", "kwargs", "dim1_of_2d", "argmin", "keepdim"])
def test_every_spelling_rewritten_exactly(spelling):
    x = hard_rows(8, 16384, torch.float32, seed=0)
    fn = {"method": lambda t: t.argmax(-1),
          "function": lambda t: torch.argmax(t, -1),
          "kwargs": lambda t: torch.argmax(t, dim=-1, keepdim=False),
          "dim1_of_2d": lambda t: t.argmax(1),
          "argmin": lambda t: t.argmin(dim=-1),
          "keepdim": lambda t: torch.argmax(t, -1, True)}[spelling]
    _, out = rewritten(fn, x)
    assert torch.equal(out, fn(x))
    assert COUNTERS["mla_compile"][COUNTER] == 1


@pytest.mark.parametrize("case", ["short_row", "many_rows", "not_last_dim", "no_dim", "integer", "prime_width"])
def test_left_alone(case):
    x = torch.randn(4, 16384)
    fn, arg = {"short_row": (lambda t: t[:, :4096].argmax(-1), x),
               "many_rows": (lambda t: t.argmax(-1), torch.randn(512, 8192)),
               "not_last_dim": (lambda t: t.argmax(0), torch.randn(16384, 4)),
               "no_dim": (lambda t: t.argmax(), x),  # over the flattened tensor
               "integer": (lambda t: t.argmax(-1), (x * 100).long()),
               "prime_width": (lambda t: t.argmax(-1), torch.randn(4, 8191 * 2 - 1))}[case]
    _, out = rewritten(fn, arg)
    assert torch.equal(out, fn(arg))
    assert COUNTERS["mla_compile"][COUNTER] == 0


@pytest.mark.parametrize("kind", ["argmax", "argmin"])
def test_inductor_kernels_agree_on_ties_nan_and_inf(kind):
    """The rewritten graph through Inductor (its own argmax / amax kernels, as the backend runs it)."""
    fn = (lambda t: t.argmax(-1, keepdim=True)) if kind == "argmax" else (lambda t: t.argmin(-1, keepdim=True))
    for dtype in (torch.float32, torch.bfloat16):
        torch._dynamo.reset()
        x = hard_rows(8, 32768, dtype, seed=1)
        _, out = rewritten(fn, x, inductor=True)
        assert torch.equal(out, fn(x)), dtype


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 8), st.sampled_from([8192, 24576, 32768, 50000]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]), st.sampled_from(["argmax", "argmin"]),
       st.integers(0, 2**31 - 1))
def test_random_rows_equal_torch(rows, n, dtype, kind, seed):
    torch._dynamo.reset()
    x = hard_rows(rows, n, dtype, seed)
    fn = (lambda t: t.argmax(-1)) if kind == "argmax" else (lambda t: t.argmin(-1))
    gm, out = rewritten(fn, x)
    assert torch.equal(out, fn(x))
    assert any(getattr(n_.target, "__name__", "") in ("amax", "amin") for n_ in gm.graph.nodes)
