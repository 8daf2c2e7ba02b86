"""HF DeepseekV3 decode on CUDA under `torch.compile(backend="mla_dcp", mode="reduce-overhead")`: the pass's
rewritten graph (strided absorbed q into mla.decode, the token table from the padding mask) through Inductor's
CUDA codegen and CUDA-graph trees, against eager HF on the same GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models as M  # noqa: E402
from mla_compile.passes import mla_attention  # noqa: E402

STEPS = 12
COUNTERS = torch._dynamo.utils.counters


def _compiled_vs_eager(model, L=96, steps=STEPS):
    """(compiled logits teacher-forced on eager's greedy tokens, eager logits): bf16 greedy paths may part at
    near-ties, so the compiled model is fed eager's tokens."""
    from transformers import StaticCache

    torch._dynamo.reset()
    COUNTERS.clear()
    model = model.cuda()
    ids, mask = M.batch(B=4, T=7, L=L, pad=3)
    ids, mask = ids.cuda(), mask.cuda()
    ref_t, ref_l = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), steps)
    compiled = torch.compile(model, backend="mla_dcp", mode="reduce-overhead", fullgraph=True)
    return M.forced(compiled, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), ref_t), ref_l


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_hf_decode_cuda_matches_eager(impl, dtype, tol):
    logits, ref_l = _compiled_vs_eager(M.deepseek_v3(num_layers=2, heads=16, hidden=256, attn_impl=impl, dtype=dtype))
    assert M.rel_err(logits, ref_l) < tol
    assert (logits.argmax(-1) == ref_l.argmax(-1)).float().mean() >= (1.0 if dtype == torch.float32 else 0.9)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2


def test_hf_decode_cuda_split_k_partials_and_combo_kernels():
    """Hidden 2048: the fused q_a + kv_a pair splits K (mla.linear_partials + graph adds folded into the RMSNorms)
    under the CUDA defaults (combo kernels on); bf16 logits follow eager HF."""
    from mla_compile.passes.fused_linear import SPLIT_COUNTER

    model = M.deepseek_v3(num_layers=1, heads=16, hidden=2048, dtype=torch.bfloat16)
    logits, ref_l = _compiled_vs_eager(model, L=64, steps=8)
    assert COUNTERS["mla_compile"][SPLIT_COUNTER] >= 1  # the decode graph's q_a + kv_a (and down_proj if split)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 1
    assert M.rel_err(logits, ref_l) < 2e-2
    assert (logits.argmax(-1) == ref_l.argmax(-1)).float().mean() >= 0.9


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_hf_decode_cuda_absorbed_projections_as_per_head_linear(dtype, tol):
    """The pass's `per_head_linear` spelling of W_UK / W_UV (the few-token Triton kernel in bf16; fp32 takes the
    op's bmm definition) under Inductor + CUDA-graph trees, against eager HF."""
    from mla_compile import tuning

    with tuning.use(tuning.Tuning(absorb="per_head_linear")):
        logits, ref_l = _compiled_vs_eager(M.deepseek_v3(num_layers=2, heads=16, hidden=256, dtype=dtype))
    assert M.rel_err(logits, ref_l) < tol
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2



@pytest.mark.parametrize("vocab", [32768, 129280])
def test_greedy_pick_split_argmax_cuda(vocab):
    """The greedy pick over a real vocab through passes/split_argmax.py + Inductor's CUDA reductions under CUDA
    graphs: the exact token (ties, NaN, inf rows included) of eager argmax, replay after replay."""
    from argmax_cases import hard_rows
    from mla_compile.passes.split_argmax import COUNTER

    torch._dynamo.reset()
    COUNTERS.clear()
    step = torch.compile(lambda lg: lg.argmax(-1, keepdim=True), backend="mla_dcp", mode="reduce-overhead",
                         fullgraph=True)
    for seed in range(6):
        x = hard_rows(8, vocab, torch.bfloat16, seed).cuda()
        assert torch.equal(step(x), x.argmax(-1, keepdim=True)), seed
    assert COUNTERS["mla_compile"][COUNTER] == 1
