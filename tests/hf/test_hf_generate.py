"""HF `generate()` with our backend, the way users call it: HF's own auto-compile of the decode step with
`compile_config=mla_compile.integrations.hf.compile_config()` (CPU here; tests/gpu/test_hf_generate_cuda.py runs
the same under CUDA graphs). fp32 tokens must equal eager generate's, and every decode graph must be rewritten."""

from __future__ import annotations

import pytest
import torch

import hf_models as M
from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache, cache_kwargs, compile_config
from mla_compile.passes import mla_attention

pytest.importorskip("transformers")
COUNTERS = torch._dynamo.utils.counters


def _generate(model, ids, mask, new, compiled: bool, cache=None, seed=None, **kw):
    if seed is not None:
        torch.manual_seed(seed)
    extra = {} if cache is None else cache_kwargs(model, cache)
    if compiled:
        extra["compile_config"] = compile_config()
    else:
        extra["disable_compile"] = True
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              cache_implementation=None if cache is not None else "static", pad_token_id=0,
                              **extra, **kw)




@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
def test_generate_compile_config_matches_eager(sample):
    model = M.deepseek_v3(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    kw = dict(do_sample=True, top_k=20, temperature=1.0) if sample else dict(do_sample=False)
    ref = _generate(model, ids, mask, 8, compiled=False, seed=3, **kw)
    M.fresh(model)
    out = _generate(model, ids, mask, 8, compiled=True, seed=3, **kw)
    assert torch.equal(out, ref)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2  # one decode graph, both layers
    assert COUNTERS["stats"]["unique_graphs"] == 1  # prefill ran eagerly (HF's auto-compile covers decode)
    again = _generate(model, ids, mask, 8, compiled=True, seed=3, **kw)  # a second call reuses the graph
    assert torch.equal(again, ref) and COUNTERS["stats"]["unique_graphs"] == 1


def test_generate_with_paged_cache():
    model = M.deepseek_v3(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    ref = _generate(model, ids, mask, 6, compiled=False)
    M.fresh(model)
    cache = MLAPagedCache(model.config, max_cache_len=16, page_size=4, shuffle_pages=True)
    out = _generate(model, ids, mask, 6, compiled=True, cache=cache)
    assert torch.equal(out, ref)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2


def test_generate_dsa_crosses_topk_dense_then_sparse():
    """V3.2: one generate() whose kv length crosses index_topk: the dense graph (indexer dropped) then the sparse
    graph (dsa.indexer_topk + mla.sparse_decode), exactly two graphs, tokens equal to eager."""
    topk = 10
    model = M.deepseek_v32(num_layers=2, index_topk=topk)
    ids, mask = M.batch(B=2, T=5, L=5, pad=1)
    new = 12  # kv length runs 6 .. 16: crosses topk = 10
    ref = _generate(model, ids, mask, new, compiled=False, cache=DSAStaticCache(model.config, max_cache_len=24))
    M.fresh(model)
    out = _generate(model, ids, mask, new, compiled=True, cache=DSAStaticCache(model.config, max_cache_len=24))
    assert torch.equal(out, ref)
    c = COUNTERS["mla_compile"]
    assert c["dsa_index_mask_dropped"] >= 1 and c["dsa_sparse_rewritten"] >= 1, dict(c)
    assert COUNTERS["stats"]["unique_graphs"] == 2


def test_optimize_generate_default_mode_cpp_wrapper_matches_eager():
    """`optimize_generate(model, mode="default", cpp_wrapper=True)` (README: the no-CUDA-graph road with the step's
    launches from Inductor's C++ wrapper): our ops are reached through the dispatcher from the generated C++, and the
    tokens equal eager generate's; the graph is rewritten and really built by the C++ wrapper (CPU here; the CUDA
    wrapper and a DSA model in tests/gpu/test_hf_generate_cuda.py)."""
    from torch._inductor.codegen import cpp_wrapper_cpu

    from mla_compile.integrations.hf import optimize_generate

    model = M.deepseek_v3(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    ref = _generate(model, ids, mask, 8, compiled=False, do_sample=False)
    M.fresh(model)
    optimize_generate(model, mode="default", cpp_wrapper=True)
    # no cache hit may stand in for the build (an earlier run's FX graph / AOT autograd cache entry)
    with M.constructions(cpp_wrapper_cpu.CppWrapperCpu) as built, torch.no_grad(), \
            torch._inductor.config.patch(force_disable_caches=True):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    assert torch.equal(out, ref)
    assert built, "no graph was built by Inductor's C++ wrapper"
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] >= 1, dict(COUNTERS["mla_compile"])


def test_prefill_graphs_compile_without_cudagraphs():
    """The README's older recipe compiles model.forward, prefill included: the backend keeps CUDA graphs off for
    the multi-token step (passes/step_kind.py: a lazily allocated HF cache would live in the graph's pool)."""
    from mla_compile import backend
    from mla_compile.passes.step_kind import multi_token_attention

    model = M.deepseek_v3(num_layers=1)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids, mask = M.batch(B=2, T=5, L=16)
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=16)
    step = torch.compile(model, backend=capture, fullgraph=True)
    with torch.no_grad():
        step(ids, attention_mask=mask[:, :5], **cache_kwargs(model, cache), cache_position=torch.arange(5))
        step(ids[:, :1], attention_mask=mask[:, :6], **cache_kwargs(model, cache), cache_position=torch.tensor([5]))
    assert len(graphs) == 2
    assert multi_token_attention(graphs[0]) is not None  # the prefill
    assert multi_token_attention(graphs[1]) is None  # the decode step
    patches = {"triton.cudagraphs": True}
    backend._prefill_without_cudagraphs(graphs[0], patches, {})
    assert patches["triton.cudagraphs"] is False
    patches = {"triton.cudagraphs": True}
    backend._prefill_without_cudagraphs(graphs[0], patches, {"triton.cudagraphs": True})  # the user's word wins
    assert patches["triton.cudagraphs"] is True


def test_cache_allocated_in_a_compiled_prefill_is_marked_static_for_cuda_graphs():
    """HF marks its cache tensors static addresses when it allocates them, except while Dynamo traces: a cache whose
    first update runs in a compiled prefill keeps them unmarked, and Inductor would run every decode graph writing
    them without CUDA graphs ("mutated inputs"). The backend marks the cache-layer tensors a CUDA-graphed step writes
    in place (passes/step_kind.unmarked_cache_state); read-only or already-marked tensors, other inputs and graphs
    compiled without CUDA graphs are left as they are."""
    from transformers import StaticCache

    from mla_compile import backend
    from mla_compile.passes.step_kind import unmarked_cache_state

    model = M.deepseek_v3(num_layers=2)
    M.fresh(model)  # no automatic dynamic sizes of this code from other tests
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids, mask = M.batch(B=2, T=5, L=16)
    step = torch.compile(model, backend=capture, fullgraph=True)

    def prefill_then_decode(cache, prefill):
        with torch.no_grad():
            prefill(ids, attention_mask=mask[:, :5], **cache_kwargs(model, cache), cache_position=torch.arange(5))
            step(ids[:, :1], attention_mask=mask[:, :6], **cache_kwargs(model, cache),
                 cache_position=torch.tensor([5]))

    prefill_then_decode(StaticCache(config=model.config, max_cache_len=16), step)  # allocated while tracing
    assert unmarked_cache_state(graphs[0]) == []  # the prefill creates the tensors: none is an input
    found = unmarked_cache_state(graphs[1])
    names = sorted(name for _, name in found)
    assert {n.rsplit(".", 1)[-1] for n in names} >= {"keys", "values"}, names
    assert {n.split(".layers[")[1][0] for n in names} == {"0", "1"}, names  # both layers
    assert all(n.startswith("L['kwargs']") for n in names), names
    backend._cache_state_as_static_inputs(graphs[1], {"triton.cudagraphs": False})  # no CUDA graphs: nothing
    assert len(unmarked_cache_state(graphs[1])) == len(found)
    backend._cache_state_as_static_inputs(graphs[1], {"triton.cudagraphs": True})
    assert unmarked_cache_state(graphs[1]) == []
    assert all(node.meta["tensor_dict"]["_dynamo_static_input_type"] == "unguarded" for node, _ in found)
    others = [p for p in graphs[1].graph.find_nodes(op="placeholder") if all(p is not n for n, _ in found)]
    assert not any(p.meta.get("tensor_dict", {}).get("_dynamo_static_input_type") == "unguarded"
                   and "kwargs" in str(getattr(p, "_dynamo_source", "")) for p in others)

    # allocated by an eager prefill: HF marked them itself
    torch._dynamo.reset()
    graphs.clear()
    prefill_then_decode(StaticCache(config=model.config, max_cache_len=16), model)
    assert unmarked_cache_state(graphs[-1]) == []


def test_compiled_forward_recipe_reduce_overhead_matches_eager():
    """`model.forward = torch.compile(model.forward, backend="mla_dcp", mode="reduce-overhead")` + generate(): the
    prefill compiles without CUDA graphs, the decode graph with its cache tensors marked static; tokens equal eager
    generate()'s (the GPU test checks the capture itself)."""
    model = M.deepseek_v3(num_layers=1)
    ids, mask = M.batch(B=2, T=5, L=5, pad=1)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, disable_compile=True, cache_implementation="static")
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, **kw)
    M.fresh(model)  # Dynamo's state of this forward's code from other tests (its automatic dynamic sizes) forgotten
    forward = model.forward
    model.forward = torch.compile(forward, backend="mla_dcp", mode="reduce-overhead")
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, **kw)
    finally:
        model.forward = forward
    assert torch.equal(out, ref)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 1


def test_unmarked_cache_state_takes_written_cache_layer_tensors_only():
    """Which inputs the marking takes: a cache layer's tensors written in place (an in-place method, through a view,
    or by setitem), not one it only reads, not a written tensor that is no cache layer's, not an already static one."""
    from mla_compile.passes.step_kind import unmarked_cache_state

    class Layer:
        def __init__(self):
            self.keys, self.values = torch.zeros(2, 4), torch.zeros(2, 4)
            self.count, self.scale = torch.zeros(()), torch.ones(4)

    class Cache:
        def __init__(self):
            self.layers = [Layer(), Layer()]

    def step(x, cache, scratch):
        first, second = cache.layers
        first.keys.index_copy_(0, torch.tensor([1]), x)  # in place
        first.values[0].add_(1.0)  # through a view
        second.keys[1] = x[0]  # setitem
        first.count.add_(1)
        scratch.mul_(2)  # written, but no cache layer's
        return (second.values * first.scale).sum() + x.sum()  # read only

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    cache, scratch = Cache(), torch.ones(3)
    torch._dynamo.mark_static_address(cache.layers[1].keys)  # already static: left alone
    torch.compile(step, backend=capture, fullgraph=True)(torch.ones(1, 4), cache, scratch)
    names = sorted(name.split(".", 1)[1] for _, name in unmarked_cache_state(graphs[0]))
    assert names == ["layers[0].count", "layers[0].keys", "layers[0].values"], names
