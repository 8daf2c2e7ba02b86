"""Dynamo's default (automatic dynamic shapes) on CUDA under CUDA-graph trees: the road of a user who writes
`torch.compile(model, backend="mla_dcp", mode="reduce-overhead")` without `dynamic=False`. A second cache length
(HF's StaticCache, our paged / DSA caches) or a second draft length makes Dynamo's next graph symbolic in that size;
the pass specializes the attention site to the call's size (passes/_fx.py `specialize_site`) and rewrites it. Here
each such graph also goes through Inductor's CUDA codegen and is captured: tokens equal eager HF's (fp32), every
length rewritten, no CUDA-graph skip, and a length seen before replays its graph (no new compile)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models as M  # noqa: E402
from mla_compile.integrations.hf import (DSAStaticCache, MLAPagedCache, cache_kwargs,  # noqa: E402
                                         create_masks_in_graph)
from mla_compile.passes import mla_attention  # noqa: E402

COUNTERS = torch._dynamo.utils.counters
STEPS = 4
TOL = 1e-4
LENGTHS = (64, 96, 128, 96)  # the last one replays the second length's graph


def _static(model, L):
    from transformers import StaticCache

    return StaticCache(config=model.config, max_cache_len=L)


def _make_cache(kind, model, L):
    if kind == "static":
        return _static(model, L)
    if kind == "paged":
        return MLAPagedCache(model.config, L, page_size=16, shuffle_pages=True)
    return DSAStaticCache(model.config, L)  # dsa_dense / dsa_sparse


def _fresh():
    torch._dynamo.reset()
    COUNTERS.clear()


@pytest.mark.parametrize("kind", ["static", "paged", "dsa_dense", "dsa_sparse"])
def test_cache_lengths_specialized_under_cuda_graphs(kind):
    """dsa_dense: index_topk 256 >= every length (the dense graph: no indexer); dsa_sparse: index_topk 4, under the
    prompt's length (the sparse graph: dsa.indexer_topk + mla.sparse_decode)."""
    layers = 2
    if kind.startswith("dsa"):
        model = M.deepseek_v32(num_layers=layers, index_topk=256 if kind == "dsa_dense" else 4, heads=16, hidden=256)
    else:
        model = M.deepseek_v3(num_layers=layers, heads=16, hidden=256)
    model = model.cuda()
    _fresh()
    compiled = torch.compile(model, backend="mla_dcp", mode="reduce-overhead", fullgraph=True)
    for L in LENGTHS:
        ids, mask = M.batch(B=4, T=7, L=L, pad=3)
        ids, mask = ids.cuda(), mask.cuda()
        ref_t, ref_l = M.greedy(model, model, ids, mask, _static(model, L), STEPS)
        t, logits = M.greedy(compiled, model, ids, mask, _make_cache(kind, model, L), STEPS, prefill=model)
        assert torch.equal(t, ref_t), (kind, L, t, ref_t)
        assert M.rel_err(logits, ref_l) < TOL, (kind, L)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.COUNTER] == 3 * layers, dict(c)  # three lengths, each its own rewritten graph
    # the second and third (symbolic) graphs: once per graph, or per layer where a symbol is a layer's own
    assert 2 <= c[mla_attention.SPECIALIZED_COUNTER] <= 2 * layers, dict(c)
    if kind.startswith("dsa"):
        dense = kind == "dsa_dense"
        assert c["dsa_index_mask_dropped"] == (3 * layers if dense else 0), dict(c)
        assert c[mla_attention.SPARSE_COUNTER] == (0 if dense else 3 * layers), dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)
    assert COUNTERS["stats"]["unique_graphs"] == 3, dict(COUNTERS["stats"])  # 96 again: its graph replays
    assert COUNTERS["inductor"]["cudagraph_skips"] == 0, dict(COUNTERS["inductor"])


def test_compiled_forward_draft_lengths_specialized_under_cuda_graphs():
    """Assisted generation through `model.forward = torch.compile(..., mode="reduce-overhead")` (Dynamo's default):
    the draft length shrinks near the end (max_new_tokens), so S turns symbolic; each verification length is
    specialized, rewritten and captured; tokens equal eager generate()'s."""
    model = M.deepseek_v3(num_layers=2, heads=16, hidden=256).cuda()
    model.create_masks_for_generate = create_masks_in_graph
    draft = M.deepseek_v3(num_layers=1, heads=16, hidden=256, seed=7).cuda()
    draft.generation_config.num_assistant_tokens = 4
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    base = torch.randint(1, 120, (1, 4), generator=torch.Generator().manual_seed(5))
    ids = base.repeat(1, 3).cuda()
    new = 14

    def run():
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=0, disable_compile=True, assistant_model=draft,
                                  **cache_kwargs(model, _static(model, ids.shape[1] + new + 8)))

    ref = run()
    _fresh()
    forward = model.forward
    model.forward = torch.compile(forward, backend="mla_dcp", mode="reduce-overhead")
    try:
        out = run()
    finally:
        model.forward = forward
    assert torch.equal(out, ref), (out, ref)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.TOKENS_COUNTER] >= 2 and c[mla_attention.SPECIALIZED_COUNTER] >= 1, dict(c)
    # the prefill's two layers (12 query tokens, not a decode step): absorbed with HF's mask (passes/attention_dense)
    assert c[mla_attention.DENSE_COUNTER] == 2 and c[mla_attention.SKIP_COUNTER] == 0, dict(c)
    # HF's StaticCache initialises lazily, here inside the compiled prefill, where it cannot mark its tensors static
    # addresses: the backend marks them for the CUDA-graphed steps (else "mutated inputs": one graph skipped)
    assert COUNTERS["inductor"]["cudagraph_skips"] == 0, dict(COUNTERS["inductor"])
