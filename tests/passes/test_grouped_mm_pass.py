"""passes/grouped_mm.py: HF's `transformers::grouped_mm_fallback` (grouped_mm experts with fp32 / fp16 weights under
torch.compile, transformers >= 5.25) rewritten into `mla.expert_linear` with expert ids from the group offsets.
Outputs equal the fallback's own (its host loop) and a float64 definition, for random groupings (empty experts,
rows past the last group); an offs the graph cannot prove nondecreasing stays the fallback, counted and logged; the
rewritten graph is snapshotted."""

from __future__ import annotations

import logging

import expecttest
import pytest
import torch
import torch.fx as fx
from hypothesis import given, settings, strategies as st

import hf_models as M
from mla_compile.passes import grouped_mm
from mla_compile.passes.grouped_mm import COUNTER, SKIP_COUNTER, rewrite_grouped_mm_fallbacks

pytest.importorskip("transformers")
moe = pytest.importorskip("transformers.integrations.moe")
if not hasattr(torch.ops.transformers, "grouped_mm_fallback"):
    pytest.skip("this transformers has no grouped_mm fallback op", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
COUNTERS = torch._dynamo.utils.counters
FALLBACK = torch.ops.transformers.grouped_mm_fallback
EXPERT_LINEAR = torch.ops.mla.expert_linear.default


def _grouped(x, w, expert_of_row):
    """HF's grouped form: counts per expert (histc, as HF on the CPU), offsets their running sum."""
    counts = torch.histc(expert_of_row.float(), bins=w.shape[0], min=0, max=w.shape[0] - 1)
    return FALLBACK(x, w, offs=torch.cumsum(counts, dim=0, dtype=torch.int32))


def _given_offs(x, w, offs):
    return FALLBACK(x, w, offs=offs)


def _compiled(fn, *args):
    """fn compiled with a backend that runs the rewrite on the Dynamo graph; (rewritten graph, output)."""
    seen = {}

    def backend(gm, example_inputs):
        rewrite_grouped_mm_fallbacks(gm)
        seen["gm"] = gm
        return gm.forward

    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return seen["gm"], out


def _calls(gm, pred) -> int:
    return sum(n.op == "call_function" and pred(n) for n in gm.graph.nodes)


def _reference(x, w, offs) -> torch.Tensor:
    """The fallback's definition in float64: rows [offs[e-1], offs[e]) times W[e], later rows zero."""
    out = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    start = 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = x[start:end].double() @ w[e].double()
        start = max(start, end)
    return out


@settings(max_examples=40, deadline=None)
@given(E=st.integers(1, 6), S=st.integers(1, 24), I=st.sampled_from([8, 16]), O=st.sampled_from([4, 12]),
       tail=st.integers(0, 3), seed=st.integers(0, 2**16))
def test_rewrite_equals_the_fallback_and_float64(E, S, I, O, tail, seed):
    """Random groupings: experts with no row, and `tail` rows past the last group (HF's sentinel rows: zero)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S + tail, I, generator=g)
    w = torch.randn(E, I, O, generator=g)
    rows = torch.sort(torch.randint(0, E, (S,), generator=g)).values
    expert_of_row = torch.cat([rows, torch.full((tail,), E)])  # tail rows: past the last bin, uncounted by histc
    gm, out = _compiled(_grouped, x, w, expert_of_row)
    assert _calls(gm, lambda n: n.target is EXPERT_LINEAR) == 1 and _calls(gm, grouped_mm._is_fallback) == 0
    want = _grouped(x, w, expert_of_row)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # the graph's own offsets (histc's: with one expert, min = max = 0 makes it count over the data's range)
    offs = torch.cumsum(torch.histc(expert_of_row.float(), bins=E, min=0, max=E - 1), 0).long()
    torch.testing.assert_close(out.double(), _reference(x, w, offs), rtol=1e-5, atol=1e-5)
    assert not out[int(offs[-1]):].any()  # rows past the last group


def test_unprovable_offs_left_alone_and_counted(caplog):
    """offs handed in (a graph input): nothing proves it nondecreasing, so the fallback stays, counted, logged."""
    x, w = torch.randn(5, 8), torch.randn(3, 8, 4)
    offs = torch.tensor([2, 2, 5], dtype=torch.int32)
    with caplog.at_level(logging.INFO, logger="mla_compile.passes.grouped_mm"):
        gm, out = _compiled(_given_offs, x, w, offs)
    assert _calls(gm, grouped_mm._is_fallback) == 1 and _calls(gm, lambda n: n.target is EXPERT_LINEAR) == 0
    assert COUNTERS["mla_compile"][SKIP_COUNTER] == 1 and COUNTERS["mla_compile"][COUNTER] == 0
    assert any("not a cumsum of expert counts" in r.getMessage() for r in caplog.records)
    torch.testing.assert_close(out, _given_offs(x, w, offs))


def test_hf_moe_forward_with_grouped_mm_experts():
    """A tiny DeepseekV3 whose layers are all MoE with grouped_mm experts (HF's default), fp32 under the mla_dcp
    backend: each layer's two grouped products rewritten, logits equal eager HF's (which runs torch's grouped_mm
    outside compile)."""
    from test_expert_gather_pass import deepseek_v3_moe

    model = deepseek_v3_moe(num_layers=2)
    model.set_experts_implementation("grouped_mm")
    ids = torch.randint(1, 128, (3, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, backend="mla_dcp", fullgraph=True)(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert COUNTERS["mla_compile"][COUNTER] == 4 and COUNTERS["mla_compile"][SKIP_COUNTER] == 0


def _op_lines(gm: fx.GraphModule) -> str:
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    index = {n: i for i, n in enumerate(nodes)}

    def fmt(a):
        if isinstance(a, fx.Node):
            return f"%{index[a]}" if a in index else "%in"
        return repr(a)

    lines = []
    for n in nodes:
        args = [fmt(a) for a in n.args] + [f"{k}={fmt(v)}" for k, v in n.kwargs.items() if k != "device"]
        v = n.meta.get("example_value")
        meta = f" -> {list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else ""
        lines.append(f"%{index[n]} = {M.node_target(n)}({', '.join(args)}){meta}")
    return "\n".join(lines)


class TestSnapshot(expecttest.TestCase):
    def test_rewritten_graph(self):
        torch._dynamo.reset()
        x, w = torch.randn(6, 8), torch.randn(3, 8, 4)
        gm, _ = _compiled(_grouped, x, w, torch.tensor([0, 0, 1, 2, 2, 2]))
        self.assertExpectedInline(_op_lines(gm), """\
%0 = .float(%in) -> [6] float32
%1 = torch.histc(%0, bins=3, min=0, max=2) -> [3] float32
%2 = torch.cumsum(%1, dim=0, dtype=torch.int32) -> [3] int32
%3 = torch.arange(6, dtype=torch.int32) -> [6] int32
%4 = torch.searchsorted(%2, %3, right=True) -> [6] int64
%5 = torch.clamp(%4, max=2) -> [6] int64
%6 = torch.transpose(%in, 1, 2) -> [3, 4, 8] float32
%7 = mla.expert_linear.default(%in, %6, %5) -> [6, 4] float32
%8 = torch.lt(%4, 3) -> [6] bool
%9 = torch.unsqueeze(%8, 1) -> [6, 1] bool
%10 = torch.zeros_like(%7) -> [6, 4] float32
%11 = torch.where(%9, %7, %10) -> [6, 4] float32""")
