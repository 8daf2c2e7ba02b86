"""`mla::expert_linear`'s CUDA path (the Triton kernel, kernels/experts.py) against a float64 per-pair loop, HF's
transposed expert layout, CUDA-graph capture with new expert ids replayed, and the MoE decode shapes from
benchmarks (DeepSeek-V3-like 2048 hidden, 8 experts top-2, batch 8). Skipped without a CUDA device."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")]

import mla_compile.ops.experts  # noqa: E402,F401  (registers mla::expert_linear)
from gpu_util import capture, rel  # noqa: E402

DEV = "cuda"
TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


def ref(x, weight, ids):
    E = weight.shape[0]
    x, weight = x.double().cpu(), weight.double().cpu()
    return torch.stack([weight[e % E] @ x[s] for s, e in enumerate(ids.tolist())])


def args(S, E, O, I, dtype, transposed, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(S, I, generator=g).to(dtype)
    w = (torch.randn(E, I, O, generator=g).to(dtype).transpose(1, 2) if transposed
         else torch.randn(E, O, I, generator=g).to(dtype))
    ids = torch.randint(-E, E, (S,), generator=g)
    return x.to(DEV), w.to(DEV), ids.to(DEV)


# (S, E, O, I): the benchmark's gate_up (O 2 x 1024) and down, odd tails, more experts than pairs
SHAPES = [(16, 8, 2048, 2048), (16, 8, 2048, 1024), (5, 3, 70, 130), (8, 64, 256, 7168)]


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("S,E,O,I", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_against_float64(S, E, O, I, dtype, transposed):
    x, w, ids = args(S, E, O, I, dtype, transposed)
    y = torch.ops.mla.expert_linear(x, w, ids)
    assert y.shape == (S, O) and y.dtype == dtype and y.is_contiguous()
    assert rel(y, ref(x, w, ids)) < TOL[dtype]


def test_float64_takes_the_gathered_definition():
    x, w, ids = args(6, 3, 40, 24, torch.float64, True)
    assert rel(torch.ops.mla.expert_linear(x, w, ids), ref(x, w, ids)) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_replay_with_new_ids(dtype):
    x, w, ids = args(16, 8, 512, 1024, dtype, False)
    graph, out = capture(lambda: torch.ops.mla.expert_linear(x, w, ids))
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        ids.copy_(torch.randint(0, 8, (16,), generator=g))
        x.copy_(torch.randn(16, 1024, generator=g).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        assert rel(out, ref(x, w, ids)) < TOL[dtype]


def test_data_check_on_request(monkeypatch):
    x, w, _ = args(4, 3, 16, 16, torch.float32, False)
    monkeypatch.setenv("MLA_COMPILE_CHECK_DATA", "1")
    with pytest.raises(ValueError, match="^expert_ids: "):
        torch.ops.mla.expert_linear(x, w, torch.tensor([0, 1, 3, 2], device=DEV))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_moe_generate_with_the_pass(dtype, monkeypatch):
    """generate() of a tiny all-MoE DeepSeek-V3 (batched_mm experts) through optimize_generate under CUDA graphs,
    with passes/expert_gather.py appended to the backend's passes: every expert product runs the kernel; fp32 tokens
    equal eager generate's, the first step's logits close in both dtypes."""
    import hf_models as M
    from mla_compile.integrations.hf import optimize_generate
    from test_expert_gather_pass import COUNTER, SKIP_COUNTER, deepseek_v3_moe, wire_into_backend

    wire_into_backend(monkeypatch)
    model = deepseek_v3_moe(num_layers=2).to(DEV, dtype)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    kw = dict(attention_mask=mask.to(DEV), max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
              return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        ref = model.generate(ids.to(DEV), cache_implementation="static", disable_compile=True, **kw)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    optimize_generate(model)
    with torch.no_grad():
        out = model.generate(ids.to(DEV), **kw)
    assert counters["mla_compile"][COUNTER] == 4 and counters["mla_compile"][SKIP_COUNTER] == 0
    assert rel(out.logits[1], ref.logits[1]) < (1e-4 if dtype == torch.float32 else 3e-2)  # the first decode step
    if dtype == torch.float32:
        assert torch.equal(out.sequences, ref.sequences)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hf_grouped_mm_experts_decode_under_cuda_graphs(dtype):
    """A tiny all-MoE DeepSeek-V3 with HF's grouped_mm experts (the default outside generate()), its decode step
    compiled by hand under reduce-overhead: with fp32 / fp16 weights HF calls its fallback op, which reads the group
    offsets on the host (no CUDA graph captures that); passes/grouped_mm.py turns it into mla.expert_linear. Every
    grouped product rewritten, no CUDA-graph skip, logits close to eager HF's (teacher-forced on its tokens)."""
    import hf_models as M
    from mla_compile.passes.grouped_mm import COUNTER, SKIP_COUNTER
    from test_expert_gather_pass import deepseek_v3_moe
    from transformers import StaticCache

    model = deepseek_v3_moe(num_layers=2).to(DEV, dtype)
    model.set_experts_implementation("grouped_mm")
    L = 16
    ids, mask = M.batch(B=2, T=6, L=L, pad=2)
    ids, mask = ids.to(DEV), mask.to(DEV)
    tokens, _ = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 4)
    want = M.forced(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), tokens)
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    compiled = torch.compile(model, backend="mla_dcp", mode="reduce-overhead", fullgraph=True)
    got = M.forced(compiled, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), tokens)
    assert counters["mla_compile"][COUNTER] == 4 and counters["mla_compile"][SKIP_COUNTER] == 0, dict(counters)
    assert rel(got, want) < (1e-4 if dtype == torch.float32 else 5e-3)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
