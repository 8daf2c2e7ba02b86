"""passes/outer_product.py: matmuls with a length-1 contraction -> broadcast multiplies, exactly, and nothing else.

Snapshot of the rewritten Dynamo graph: `EXPECTTEST_ACCEPT=1 pytest tests/passes/test_outer_product_pass.py`."""

from __future__ import annotations

import operator

import expecttest
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mla_compile.passes.outer_product import COUNTER, matmuls_to_outer_products
from test_fused_linear_pass import op_lines

COUNTERS = torch._dynamo.utils.counters
pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def rotary_angles(inv_freq, position_ids):
    """transformers <= 5.17's rotary embedding angles (DeepseekV3RotaryEmbedding.forward)."""
    inv = inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
    pos = position_ids[:, None, :].float()
    freqs = (inv @ pos).transpose(1, 2)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def compiled_graph(fn, *args):
    graphs = []

    def backend(gm, example_inputs):
        matmuls_to_outer_products(gm)
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0], out


class TestOuterProductSnapshot(expecttest.TestCase):
    def test_rotary_angles(self):
        inv_freq = 1.0 / 10000 ** (torch.arange(0, 64, 2).float() / 64)
        pos = torch.tensor([[4097], [33]])
        gm, out = compiled_graph(rotary_angles, inv_freq, pos)
        for got, want in zip(out, rotary_angles(inv_freq, pos)):
            assert torch.equal(got, want)
        self.assertEqual(COUNTERS["mla_compile"][COUNTER], 1)
        self.assertExpectedInline(op_lines(gm), """\
%0 = getitem(l_inv_freq_, [None, slice(None, None, None), None])
%1 = float(%0)
%2 = expand(%1, 2, -1, 1)
%3 = getitem(l_position_ids_, [slice(None, None, None), None, slice(None, None, None)])
%4 = float(%3)
%5 = mul(%2, %4)
%6 = transpose(%5, 1, 2)
%7 = cat([%6, %6])
%8 = cos(%7)
%9 = sin(%7)""")


def all_forms(a, b, c, d):
    """K = 1 through every spelling the pass knows, with batch broadcasting; and two products it must keep."""
    return (a @ b, torch.matmul(a, b), a.matmul(b), torch.bmm(a, b), a.bmm(b), a[0] @ b,  # a[0]: broadcast batch
            a[0] @ b[0],  # 2-D x 2-D
            c @ d)  # K = 2: a real GEMM, kept


def test_every_spelling_rewritten_exactly():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, 1, generator=g), torch.randn(3, 1, 4, generator=g)
    c, d = torch.randn(3, 5, 2, generator=g), torch.randn(3, 2, 4, generator=g)
    gm, out = compiled_graph(all_forms, a, b, c, d)
    for got, want in zip(out, all_forms(a, b, c, d)):
        assert torch.equal(got, want)
    assert COUNTERS["mla_compile"][COUNTER] == 7
    kept = [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target not in (operator.mul,
                                                                                             operator.getitem)]
    assert kept == [operator.matmul]  # c @ d


@pytest.mark.parametrize("case", ["1d", "int", "mixed_dtype"])
def test_left_alone(case):
    a, b = torch.randn(5, 1), torch.randn(1, 4)
    fn = {"1d": lambda x, y: x[0] @ y,  # [1] @ [1, 4]: 1-D operands follow other rules
          "int": lambda x, y: (x * 10).long() @ (y * 10).long(),
          "mixed_dtype": lambda x, y: x @ y.double()}[case]
    if case == "mixed_dtype":
        with pytest.raises(Exception):  # eager refuses it too: the pass must not make it run
            compiled_graph(fn, a, b)
        return
    gm, out = compiled_graph(fn, a, b)
    assert torch.equal(out, fn(a, b))
    assert COUNTERS["mla_compile"][COUNTER] == 0


@settings(max_examples=40)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 6), st.sampled_from([torch.float32, torch.bfloat16,
                                                                                  torch.float64]),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_random_shapes_bitwise_equal(batch, m, n, dtype, broadcast_batch, seed):
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(batch, m, 1, generator=g).to(dtype)
    b = torch.randn(1 if broadcast_batch else batch, 1, n, generator=g).to(dtype)
    gm, out = compiled_graph(lambda x, y: x @ y, a, b)
    assert torch.equal(out, a @ b)
    assert not any(n_.target is operator.matmul for n_ in gm.graph.nodes)
