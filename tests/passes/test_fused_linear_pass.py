"""passes/fused_linear.py: bias-free linears over the same x -> one mla.fused_linear, and nothing else.

The op's CPU impl is F.linear per weight, so on CPU the rewrite must reproduce eager outputs; `fuse_linears=
"always"` makes it fire on CPU (auto fires only on CUDA fp16/bf16 with <= 16 rows). Snapshot of a small
module's rewritten Dynamo graph: `EXPECTTEST_ACCEPT=1 pytest tests/passes/test_fused_linear_pass.py`.
"""

from __future__ import annotations

import collections

import expecttest
import pytest
import torch
import torch.nn as nn
from hypothesis import example, given, settings
from hypothesis import strategies as st
from transformers import StaticCache

import hf_models as M
from mla_compile import tuning
from mla_compile.passes.fused_linear import COUNTER, SPLIT_COUNTER, fuse_shared_input_linears

COUNTERS = torch._dynamo.utils.counters


class Shared(nn.Module):
    """a, b: bias-free over x (fused); c: over x with a bias (left); d: over another input (left)."""

    def __init__(self, K=16):
        super().__init__()
        self.a, self.b = nn.Linear(K, 8, bias=False), nn.Linear(K, 4, bias=False)
        self.c, self.d = nn.Linear(K, 3), nn.Linear(K, 5, bias=False)

    def forward(self, x, y):
        return self.a(x).sum(-1) + self.b(x).sum(-1) * 2 + self.c(x).sum(-1) + self.d(y).sum(-1)


def dynamo_graph(model, *args, where="always"):
    graphs = []

    def backend(gm, example_inputs):
        fuse_shared_input_linears(gm, where)
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend, fullgraph=True)(*args)
    return graphs[0], out


def op_lines(gm) -> str:
    names = {}

    def fmt(a):
        if isinstance(a, torch.fx.Node):
            return names.get(a, a.name if a.op == "placeholder" else "?")
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(fmt(v) for v in a) + "]"
        return repr(a)

    lines = []
    for n in gm.graph.nodes:
        if n.op in ("call_function", "call_method"):
            names[n] = f"%{len(names)}"
            tgt = getattr(n.target, "__name__", str(n.target))
            lines.append(f"{names[n]} = {tgt}({', '.join(fmt(a) for a in n.args)})")
    return "\n".join(lines)


pytestmark = pytest.mark.usefixtures("fresh_dynamo")


class TestFusedLinearSnapshot(expecttest.TestCase):
    def test_rewritten_graph(self):
        model = Shared()
        x, y = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
        gm, out = dynamo_graph(model, x, y)
        torch.testing.assert_close(out, model(x, y), rtol=0, atol=0)
        self.assertEqual(COUNTERS["mla_compile"][COUNTER], 1)
        self.assertExpectedInline(op_lines(gm), """\
%0 = fused_linear.default(l_x_, [l_self_modules_a_parameters_weight_, l_self_modules_b_parameters_weight_])
%1 = getitem(%0, 0)
%2 = getitem(%0, 1)
%3 = sum(%1, -1)
%4 = sum(%2, -1)
%5 = mul(%4, 2)
%6 = add(%3, %5)
%7 = linear(l_x_, l_self_modules_c_parameters_weight_, l_self_modules_c_parameters_bias_)
%8 = sum(%7, -1)
%9 = add(%6, %8)
%10 = linear(l_y_, l_self_modules_d_parameters_weight_, None)
%11 = sum(%10, -1)
%12 = add(%9, %11)""")


@pytest.mark.parametrize("where,groups", [("always", 1), ("never", 0), ("auto", 0)])  # auto: CPU -> no
def test_where(where, groups):
    model = Shared()
    x, y = torch.randn(3, 16), torch.randn(3, 16)
    _, out = dynamo_graph(model, x, y, where=where)
    torch.testing.assert_close(out, model(x, y), rtol=0, atol=0)
    assert COUNTERS["mla_compile"][COUNTER] == groups


def test_bad_option_names_the_key():
    from mla_compile.backend import parse_options

    with pytest.raises(ValueError, match=r"^options: 'fuse_linears' must be one of auto, always, never"):
        parse_options({"fuse_linears": "sometimes"})


def assert_fused_greedy_matches_eager(model, L=32, steps=4):
    """Greedy decode of `model` compiled with the projections always fused: the same tokens as eager HF, logits
    within 1e-4 (prefill eager in both)."""
    ids, mask = M.batch(L=L)
    ref_t, ref_l = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), steps)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True, options={"fuse_linears": "always"})
    t, logits = M.greedy(compiled, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), steps,
                         prefill=model)
    assert torch.equal(t, ref_t)
    assert M.rel_err(logits, ref_l) < 1e-4


@pytest.mark.parametrize("name,build,kwargs,layers,groups", [
    # V3: per layer q_a (or q) + kv_a, and gate + up
    ("v3-qlora", M.deepseek_v3, dict(q_lora_rank=96), 2, 4), ("v3-noqlora", M.deepseek_v3, dict(q_lora_rank=None), 2, 4),
    # DSA: q_a + kv_a + the indexer's wk over the hidden states, q_b + the indexer's wq_b over q_resid, gate + up
    ("v32", M.deepseek_v32, dict(index_topk=8), 1, 3), ("glm-moe-dsa", M.glm_moe_dsa, {}, 1, 3)])
def test_hf_decode_with_fused_projections_matches_eager(name, build, kwargs, layers, groups):
    """Greedy decode with the projections fused equals eager HF; the attention is still rewritten."""
    assert_fused_greedy_matches_eager(build(num_layers=layers, **kwargs))
    assert COUNTERS["mla_compile"][COUNTER] == groups
    assert COUNTERS["mla_compile"]["mla_attention_rewritten"] == layers


def test_training_graph_gradients_match_eager():
    """The fused op carries the linears' gradients: a compiled training step equals eager."""
    model = Shared()
    x, y = torch.randn(3, 16, requires_grad=True), torch.randn(3, 16)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True, options={"fuse_linears": "always"})
    compiled(x, y).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    assert COUNTERS["mla_compile"][COUNTER] == 1
    x.grad = None
    model.zero_grad()
    model(x, y).sum().backward()
    for a, b in zip(got, [x.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b)


class TwoLoneLinears(nn.Module):
    """Two bias-free linears over different inputs: each alone, (K, N) given per linear."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = nn.Linear(*a, bias=False), nn.Linear(*b, bias=False)

    def forward(self, x, y):
        return self.a(x).sum(-1) + self.b(y).sum(-1)


def _lone_linears_graph(a, b):
    model = TwoLoneLinears(a, b)
    x, y = torch.randn(2, a[0]), torch.randn(2, b[0])
    gm, out = dynamo_graph(model, x, y)
    torch.testing.assert_close(out, model(x, y))
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and "linear" in str(n.target)], gm


def test_lone_linear_goes_to_the_op_with_k_from_1024_and_n_to_8192():
    """q_b_proj / o_proj / down_proj shapes go to the op, a short K or lm_head's wide N stay linears."""
    from mla_compile.passes import fused_linear

    linears, gm = _lone_linears_graph((8192, 4), (16, 4))
    assert COUNTERS["mla_compile"][COUNTER] == 1
    # 2 rows x K 8192 over 4 weight rows: the kernel policy splits K 8 ways -> partials + adds in the graph
    assert linears == [torch.ops.mla.linear_partials.default, torch._C._nn.linear]
    assert COUNTERS["mla_compile"][SPLIT_COUNTER] == 1
    assert sum(n.target is torch.ops.aten.add.Tensor for n in gm.graph.nodes) == 7
    t = tuning.current()
    assert fused_linear._lone_worth_it(torch.empty(t.lone_linear_max_n, t.lone_linear_min_k))
    assert not fused_linear._lone_worth_it(torch.empty(32768, 2048))  # lm_head
    assert not fused_linear._lone_worth_it(torch.empty(2048, 512))


def test_lone_linear_n_cap():
    """A lone linear wider than the cap stays a linear."""
    with tuning.use(tuning.Tuning(lone_linear_min_k=16, lone_linear_max_n=8)):
        linears, _ = _lone_linears_graph((16, 8), (16, 9))  # N 8 within the cap, N 9 above it
    assert COUNTERS["mla_compile"][COUNTER] == 1
    assert linears == [torch.ops.mla.fused_linear.default, torch._C._nn.linear]


class RandomLinears(nn.Module):
    """Linears over a few inputs, some sharing x, some with a bias, one consuming another's output."""

    def __init__(self, spec, K):
        super().__init__()
        self.spec = spec  # (input index, out features, bias) per linear; input 2 is linear 0's output
        self.lins = nn.ModuleList(nn.Linear(K if src < 2 else spec[0][1], n, bias=b) for src, n, b in spec)

    def forward(self, x0, x1):
        first = self.lins[0](x0)
        ins = [x0, x1, first]
        return [first] + [lin(ins[src]) for (src, _, _), lin in zip(self.spec[1:], self.lins[1:])]


@settings(max_examples=12, deadline=None)
# a fused group whose output feeds another group (found by this test: the second op was built on the erased node)
@example(spec=[(0, 4, False), (0, 3, False), (2, 5, False), (2, 2, False)], K=6, rows=2)
@given(spec=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9), st.booleans()), min_size=2, max_size=6),
       K=st.integers(1, 12), rows=st.integers(1, 3))
def test_random_linear_graphs_keep_their_outputs(spec, K, rows):
    """Semantics preservation: whatever groups the pass forms, every output equals eager's."""
    spec = [(0, *spec[0][1:])] + spec[1:]  # linear 0 reads x0
    torch.manual_seed(0)
    model = RandomLinears(spec, K)
    x0, x1 = torch.randn(rows, K), torch.randn(rows, K)
    torch._dynamo.reset()
    COUNTERS.clear()
    _, out = dynamo_graph(model, x0, x1)
    for a, b in zip(out, model(x0, x1)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    shared = collections.Counter(src for src, _, bias in spec if not bias)
    assert COUNTERS["mla_compile"][COUNTER] == sum(1 for n in shared.values() if n >= 2)


class QaKva(nn.Module):
    """MLA's q_a + kv_a (DeepSeek-V3 hidden 2048: K 2048, rows 1536 + 576) then RMSNorm-like consumers."""

    def __init__(self, K=2048):
        super().__init__()
        self.q_a, self.kv_a = nn.Linear(K, 1536, bias=False), nn.Linear(K, 576, bias=False)

    def forward(self, x):
        q, kv = self.q_a(x), self.kv_a(x)
        return q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6), kv[..., :512].sum(-1), kv[..., 512:]


class TestSplitKSnapshot(expecttest.TestCase):
    def test_split_k_group_is_partials_plus_adds(self):
        """8 rows x K 2048 over 2112 weight rows: the kernel policy splits K 4 ways; the sum is in the graph."""
        model = QaKva()
        x = torch.randn(8, 1, 2048)
        gm, out = dynamo_graph(model, x)
        for got, want in zip(out, model(x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # fp32: another summation order
        self.assertEqual(COUNTERS["mla_compile"][SPLIT_COUNTER], 1)
        self.assertExpectedInline(op_lines(gm), """\
%0 = reshape.default(l_x_, [8, 2048])
%1 = linear_partials.default(%0, [l_self_modules_q_a_parameters_weight_, l_self_modules_kv_a_parameters_weight_], 4)
%2 = slice.Tensor(%1, 2, 0, 1536)
%3 = select.int(%2, 0, 0)
%4 = select.int(%2, 0, 1)
%5 = add.Tensor(%3, %4)
%6 = select.int(%2, 0, 2)
%7 = add.Tensor(%5, %6)
%8 = select.int(%2, 0, 3)
%9 = add.Tensor(%7, %8)
%10 = _to_copy.default(%9)
%11 = reshape.default(%10, [8, 1, 1536])
%12 = slice.Tensor(%1, 2, 1536, 2112)
%13 = select.int(%12, 0, 0)
%14 = select.int(%12, 0, 1)
%15 = add.Tensor(%13, %14)
%16 = select.int(%12, 0, 2)
%17 = add.Tensor(%15, %16)
%18 = select.int(%12, 0, 3)
%19 = add.Tensor(%17, %18)
%20 = _to_copy.default(%19)
%21 = reshape.default(%20, [8, 1, 576])
%22 = pow(%11, 2)
%23 = mean(%22, -1)
%24 = add(%23, 1e-06)
%25 = rsqrt(%24)
%26 = mul(%11, %25)
%27 = getitem(%21, [Ellipsis, slice(None, 512, None)])
%28 = sum(%27, -1)
%29 = getitem(%21, [Ellipsis, slice(512, None, None)])""")


def test_split_k_through_inductor_and_autograd():
    """The partials op + adds compile with Inductor (CPU) and train: outputs and gradients equal eager."""
    model = QaKva(K=1024)
    x = torch.randn(4, 1, 1024, requires_grad=True)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True, options={"fuse_linears": "always"})
    outs = compiled(x)
    assert COUNTERS["mla_compile"][SPLIT_COUNTER] == 1
    sum(o.square().sum() for o in outs).backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    x.grad = None
    model.zero_grad()
    want = model(x)
    for a, b in zip(outs, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    sum(o.square().sum() for o in want).backward()
    for a, b in zip(got, [x.grad] + [p.grad for p in model.parameters()]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_hf_decode_split_k_partials_matches_eager():
    """Hidden 1024 (K split in 2 for q_a + kv_a): HF decode through mla.linear_partials + graph adds equals eager."""
    assert_fused_greedy_matches_eager(M.deepseek_v3(num_layers=1, hidden=1024))
    assert COUNTERS["mla_compile"][SPLIT_COUNTER] >= 1
    assert COUNTERS["mla_compile"]["mla_attention_rewritten"] == 1


def test_auto_uses_the_few_token_kernels_only_under_cuda_graphs(monkeypatch):
    """`auto` weighs a kernel launch of ours (host time) against the GPU time it saves: only graphs that replay as
    CUDA graphs take the few-token kernels. The backend tells the passes which kind of graph it compiles."""
    from torch._subclasses import FakeTensorMode

    from mla_compile import backend
    from mla_compile.passes import fused_linear

    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(8, 2048, dtype=torch.bfloat16, device="cuda")  # a decode batch on CUDA (fake: no GPU needed)
    assert fused_linear.few_token_worth_it(x)  # passes called directly: as under CUDA graphs
    with fused_linear.compiling_for_cuda_graphs(False):
        assert not fused_linear.few_token_worth_it(x)
    assert fused_linear.few_token_worth_it(x)

    seen = []
    real = backend.rewrite_graph

    def spy(gm, example_inputs, opts):
        seen.append(fused_linear._CUDA_GRAPHS.get())
        return real(gm, example_inputs, opts)

    monkeypatch.setattr(backend, "rewrite_graph", spy)
    for mode, want in ((None, False), ("reduce-overhead", True), ("default", False)):
        torch._dynamo.reset()
        torch.compile(lambda a: a * 2 + 1, backend="mla_dcp", mode=mode)(torch.ones(4))
        assert seen[-1] is want, (mode, seen)
