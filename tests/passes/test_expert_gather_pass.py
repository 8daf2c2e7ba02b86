"""passes/expert_gather.py: HF's batched_mm experts (`bmm(W[ids], x[..., None])`, and the transposed form with a
bias) -> `mla.expert_linear`, on the real HF MoE forwards (tiny DeepSeek-V3 with MoE layers; tiny GPT-OSS:
transposed experts with biases), logits against eager; every gathered product it cannot prove stays unchanged and
is counted; through generate() with the pass wired into the backend's pass list; a snapshot of the rewritten graph.

Regenerate the snapshot with `EXPECTTEST_ACCEPT=1 pytest tests/passes/test_expert_gather_pass.py`."""

from __future__ import annotations

import copy
import operator

import expecttest
import pytest
import torch

import hf_models as M
from mla_compile import models
from mla_compile.passes import expert_gather
from mla_compile.passes.expert_gather import COUNTER, SKIP_COUNTER, rewrite_expert_gathers
from test_fused_linear_pass import op_lines

transformers = pytest.importorskip("transformers")
COUNTERS = torch._dynamo.utils.counters
pytestmark = pytest.mark.usefixtures("fresh_dynamo")
EXPERT_LINEAR = torch.ops.mla.expert_linear.default


def deepseek_v3_moe(num_layers: int = 2, experts: int = 4, top_k: int = 2):
    """A tiny DeepseekV3ForCausalLM whose every layer is MoE (models.deepseek_v3 keeps them all dense), batched_mm
    experts (what generate() switches to for decode off the CPU)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(q_lora_rank=96, n_routed_experts=experts, num_experts_per_tok=top_k, n_group=1, topk_group=1,
                           first_k_dense_replace=0, **models._common(num_layers, 64, 4, 128, "sdpa", 4096))
    model = models.spread_weights(DeepseekV3ForCausalLM(cfg), 0, torch.float32)
    with torch.no_grad():  # HF inits the 3-D expert weights tiny too
        for p in model.parameters():
            if p.dim() == 3:
                p.normal_(0.0, 1.0 / p.shape[-1] ** 0.5)
    model.set_experts_implementation("batched_mm")
    return model


def gpt_oss_moe():
    """A tiny GptOssForCausalLM: HF's transposed experts ([E, I, O]) with biases, batched_mm."""
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                       layer_types=["full_attention"] * 2)
    torch.manual_seed(0)
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.set_experts_implementation("batched_mm")
    return model


def compiled(fn, *args, rewrite=rewrite_expert_gathers):
    """fn compiled with a backend that runs `rewrite` on the Dynamo graph and then the graph itself; returns
    (the graph before, the graph after, the output)."""
    seen = {}

    def backend(gm, example_inputs):
        seen["before"] = copy.deepcopy(gm)
        rewrite(gm)
        seen["after"] = gm
        return gm.forward

    with torch.no_grad():
        out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return seen["before"], seen["after"], out


def calls(gm, target) -> int:
    return sum(n.op == "call_function" and n.target == target for n in gm.graph.nodes)


def gathers_of_parameters(gm) -> int:
    """`W[ids]` of a rank-3 graph input (an expert weight gathered per pair)."""
    gathers = [expert_gather.as_gather(n) for n in gm.graph.nodes]
    return sum(g is not None and g.weight.op == "placeholder" for g in gathers)


def bias_gathers(gm) -> int:
    return sum(n.op == "call_function" and n.target is operator.getitem and n.args[0].op == "placeholder"
               and "bias" in n.args[0].name for n in gm.graph.nodes)


@pytest.mark.parametrize("build,layers", [(deepseek_v3_moe, 2), (gpt_oss_moe, 2)], ids=["deepseek_v3", "gpt_oss"])
def test_hf_moe_forward_rewritten_and_equal(build, layers):
    model = build()
    ids = torch.randint(1, 128, (3, 4), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(ids).logits
    before, after, out = compiled(model, ids)
    torch.testing.assert_close(out.logits, want, rtol=1e-5, atol=1e-5)
    assert COUNTERS["mla_compile"][COUNTER] == 2 * layers  # gate_up and down per MoE layer
    assert COUNTERS["mla_compile"][SKIP_COUNTER] == 0
    assert calls(after, EXPERT_LINEAR) == 2 * layers and calls(before, EXPERT_LINEAR) == 0
    assert calls(after, torch.bmm) == 0 and calls(before, torch.bmm) == 2 * layers
    # the weight gathers are gone; GPT-OSS's bias gathers stay (HF adds the biases itself)
    biases = 2 * layers if build is gpt_oss_moe else 0
    assert gathers_of_parameters(after) == 0 and gathers_of_parameters(before) == 2 * layers
    assert bias_gathers(after) == bias_gathers(before) == biases


def moe_left_alone(case, W, Wt, ids, x):
    """Products of gathered rank-3 tensors the pass must keep (each a site it counts), and products it never
    looks at (no gather)."""
    if case == "computed_weight":  # W is not a graph input: (W * 2)[ids]
        return torch.bmm((W * 2)[ids], x[:, :, None])
    if case == "ids_2d":  # ids [2, 3]: a rank-4 product (matmul broadcasting), not one pair per batch entry
        return torch.matmul(W[ids.view(2, 3)], x.view(2, 3, 5, 1))
    if case == "two_indices":  # W[ids, :]: the same values, but a tuple index this pass does not take apart
        return torch.bmm(W[ids, :], x[:, :, None])
    if case == "written_between":  # W changes after the gather: the copy holds the old values
        sel = W[ids]
        W.mul_(2)
        return torch.bmm(sel, x[:, :, None])
    if case == "copy_written":  # the gathered copy itself changes before the product (W does not)
        sel = W[ids]
        sel.transpose(1, 2).mul_(2)
        return torch.bmm(sel, x[:, :, None])
    if case == "wide_activations":  # [S, I, 2]: two columns per pair, not a linear of one activation vector
        return torch.bmm(W[ids], torch.stack([x, x], -1))
    if case == "index_select":  # refuses negative ids, where the op reads them from the end
        return torch.bmm(W.index_select(0, ids.clamp(0)), x[:, :, None])
    if case == "autocast":  # a float32 bmm computes (and returns) bfloat16 here; the op would not
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.bmm(W[ids], x[:, :, None])
    if case == "no_gather":  # a plain bmm: not a site
        return torch.bmm(W, Wt)
    raise AssertionError(case)


@pytest.mark.parametrize("case,sites", [("computed_weight", 1), ("ids_2d", 1), ("two_indices", 1),
                                        ("written_between", 1), ("wide_activations", 1), ("index_select", 1),
                                        ("autocast", 1), ("copy_written", 1), ("no_gather", 0)])
def test_unprovable_sites_unchanged_and_counted(case, sites, caplog):
    g = torch.Generator().manual_seed(1)
    W = torch.randn(4, 6, 5, generator=g)
    Wt, ids, x = torch.randn(4, 5, 6, generator=g), torch.tensor([0, 3, 3, 1, -1, 2]), torch.randn(6, 5, generator=g)
    want = moe_left_alone(case, W.clone(), Wt, ids, x)
    with caplog.at_level("INFO", logger=expert_gather.__name__):
        before, after, out = compiled(lambda *a: moe_left_alone(case, *a), W.clone(), Wt, ids, x)
    torch.testing.assert_close(out, want)
    assert COUNTERS["mla_compile"][COUNTER] == 0
    assert COUNTERS["mla_compile"][SKIP_COUNTER] == sites
    assert op_lines(after) == op_lines(before)
    skips = [r for r in caplog.records if "not rewritten" in r.getMessage()]
    assert len(skips) == sites  # once per site, with its reason


def test_transposed_views_of_the_gather():
    # W[ids].transpose(1, 2) / .permute(0, 2, 1) on either side: the per-pair matrix is a view of the gathered copy
    g = torch.Generator().manual_seed(5)
    W_oi, W_io = torch.randn(3, 7, 5, generator=g), torch.randn(3, 5, 7, generator=g)  # [E, O, I], [E, I, O]
    ids, x = torch.tensor([2, 0, -3, 1, 1]), torch.randn(5, 5, generator=g)

    def f(W_oi, W_io, ids, x):
        return (torch.bmm(W_io[ids].transpose(1, 2), x.unsqueeze(-1)).squeeze(-1),  # [S, O, I] from [E, I, O]
                torch.bmm(x.unsqueeze(1), W_oi[ids].transpose(-1, -2)).squeeze(1),  # [S, I, O] from [E, O, I]
                torch.bmm(W_io[ids].permute(0, 2, 1), x.unsqueeze(2)).squeeze(2))

    _, after, out = compiled(f, W_oi, W_io, ids, x)
    want = f(W_oi, W_io, ids, x)
    for got, ref in zip(out, want):
        torch.testing.assert_close(got, ref)
    torch.testing.assert_close(want[0], torch.einsum("sio,si->so", W_io[ids], x))  # the form means what it says
    assert COUNTERS["mla_compile"][COUNTER] == 3 and COUNTERS["mla_compile"][SKIP_COUNTER] == 0
    assert calls(after, EXPERT_LINEAR) == 3 and calls(after, torch.bmm) == 0
    assert gathers_of_parameters(after) == 0


def test_internal_error_leaves_the_site_and_warns(monkeypatch, caplog):
    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(expert_gather, "_pairs", broken)
    W, ids, x = torch.randn(3, 4, 5), torch.tensor([0, 2]), torch.randn(2, 5)
    with caplog.at_level("WARNING", logger=expert_gather.__name__):
        before, after, out = compiled(lambda W, ids, x: torch.bmm(W[ids], x[:, :, None]), W, ids, x)
    torch.testing.assert_close(out, torch.bmm(W[ids], x[:, :, None]))
    assert op_lines(after) == op_lines(before)
    assert COUNTERS["mla_compile"][SKIP_COUNTER] == 1 and COUNTERS["mla_compile"][COUNTER] == 0
    assert any("internal error RuntimeError: boom" in r.getMessage() for r in caplog.records)


def test_select_when_activations_are_not_an_unsqueeze():
    # x[:, :, None] (a getitem, not an unsqueeze) and HF's transposed form spelled as matmul: still rewritten
    g = torch.Generator().manual_seed(2)
    W, Wt = torch.randn(3, 7, 5, generator=g), torch.randn(3, 5, 7, generator=g)
    ids, x = torch.tensor([2, 0, -3, 1]), torch.randn(4, 5, generator=g)

    def f(W, Wt, ids, x):
        return torch.bmm(W[ids], x[:, :, None]).squeeze(-1), (x[:, None, :] @ Wt[ids]).squeeze(1)

    _, after, out = compiled(f, W, Wt, ids, x)
    for got, want in zip(out, f(W, Wt, ids, x)):
        torch.testing.assert_close(got, want)
    assert COUNTERS["mla_compile"][COUNTER] == 2 and calls(after, EXPERT_LINEAR) == 2
    assert calls(after, torch.select) == 2


def test_symbolic_pairs():
    # dynamic=True: S (pairs) symbolic, E / O / I static; one graph serves both sizes
    g = torch.Generator().manual_seed(4)
    W = torch.randn(4, 6, 5, generator=g)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(rewrite_expert_gathers(gm))
        return gm.forward

    f = torch.compile(lambda W, ids, x: torch.bmm(W[ids], x.unsqueeze(-1)).squeeze(-1), backend=backend, dynamic=True)
    for S in (3, 7):
        ids, x = torch.randint(-4, 4, (S,), generator=g), torch.randn(S, 5, generator=g)
        torch.testing.assert_close(f(W, ids, x), torch.bmm(W[ids], x.unsqueeze(-1)).squeeze(-1))
    assert graphs == [1] and COUNTERS["mla_compile"][COUNTER] == 1


def wire_into_backend(monkeypatch):
    """The backend runs this pass by default (`rewrite_experts`): assert it is in its pass list."""
    from mla_compile import backend

    names = [p.name for p in backend.build_pass_manager(backend.BackendOptions()).passes]
    assert "expert_gather" in names, names
    off = backend.build_pass_manager(backend.BackendOptions(rewrite_experts=False)).passes
    assert "expert_gather" not in [p.name for p in off]


def test_generate_with_the_pass_in_the_backend(monkeypatch):
    """generate() through optimize_generate with the backend's own pass list (expert_gather in it by default): tokens
    and logits as eager generate's, every MoE product rewritten."""
    from mla_compile.integrations.hf import optimize_generate

    wire_into_backend(monkeypatch)
    model = deepseek_v3_moe(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    kw = dict(attention_mask=mask, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model.generate(ids, cache_implementation="static", disable_compile=True, **kw)
    torch._dynamo.reset()
    COUNTERS.clear()
    optimize_generate(model, mode=None)
    with torch.no_grad():
        out = model.generate(ids, **kw)
    assert torch.equal(out.sequences, ref.sequences)
    for got, want in zip(out.logits, ref.logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert COUNTERS["mla_compile"][COUNTER] == 4, dict(COUNTERS["mla_compile"])  # 2 layers x (gate_up, down)
    assert COUNTERS["mla_compile"][SKIP_COUNTER] == 0
    assert COUNTERS["mla_compile"]["mla_attention_rewritten"] == 2


class TestExpertGatherSnapshot(expecttest.TestCase):
    def test_hf_deepseek_v3_experts(self):
        experts = deepseek_v3_moe(num_layers=1).model.layers[0].mlp.experts
        g = torch.Generator().manual_seed(3)
        hidden = torch.randn(3, 64, generator=g)
        top_k_index = torch.tensor([[0, 3], [3, 1], [2, 0]])
        top_k_weights = torch.rand(3, 2, generator=g)
        want = experts(hidden, top_k_index, top_k_weights)
        _, after, out = compiled(experts, hidden, top_k_index, top_k_weights)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        self.assertExpectedInline(op_lines(after), """\
%0 = repeat_interleave(l_args_0_, 2)
%1 = reshape(l_args_2_, -1)
%2 = reshape(l_args_1_, -1)
%3 = expert_linear.default(%0, l_self_parameters_gate_up_proj_, %2)
%4 = unsqueeze(%3, 2)
%5 = squeeze(%4, -1)
%6 = chunk(%5, 2)
%7 = getitem(%6, 0)
%8 = getitem(%6, 1)
%9 = silu(%7)
%10 = mul(%9, %8)
%11 = expert_linear.default(%10, l_self_parameters_down_proj_, %2)
%12 = unsqueeze(%11, 2)
%13 = squeeze(%12, -1)
%14 = unsqueeze(%1, -1)
%15 = mul(%13, %14)
%16 = view(%15, 3, 2, 64)
%17 = sum(%16)
%18 = to(%17, torch.float32)""")
