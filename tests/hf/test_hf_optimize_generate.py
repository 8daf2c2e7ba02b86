"""`optimize_generate(model)`: the one call that sets generate() up for our backend (compile config, static cache,
the mask built in the graph, HF's deferred stop check on CUDA). fp32 tokens must equal eager generate's, every
decode layer must be rewritten (sdpa and eager attention), and the deferral hook must answer with HF's own rule
only inside this model's generate() on CUDA (tests/gpu/test_hf_generate_cuda.py runs the deferral itself)."""

from __future__ import annotations

import pytest
import torch

import hf_models as M
from mla_compile.integrations import generate as G
from mla_compile.integrations.hf import MLAPagedCache, cache_kwargs, optimize_generate
from mla_compile.passes import mla_attention

transformers = pytest.importorskip("transformers")
from transformers.generation import utils as gen_utils  # noqa: E402

COUNTERS = torch._dynamo.utils.counters


def _eager(model, ids, mask, new, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                              cache_implementation="static", disable_compile=True, **kw)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_optimize_generate_matches_eager_and_rewrites(attn):
    model = M.deepseek_v3(num_layers=2, attn_impl=attn)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    ref = _eager(model, ids, mask, 8, do_sample=False)
    torch._dynamo.reset()
    COUNTERS.clear()
    assert optimize_generate(model) is model
    cfg = model.generation_config
    assert cfg.compile_config.backend == "mla_dcp" and cfg.cache_implementation == "static"
    with torch.no_grad():  # the plain call: no cache_implementation, no compile_config
        out = model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, do_sample=False,
                             pad_token_id=0)
    assert torch.equal(out, ref)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2, dict(COUNTERS["mla_compile"])
    assert COUNTERS["mla_compile"].get("mla_attention_not_rewritten", 0) == 0
    assert COUNTERS["stats"]["unique_graphs"] == 1


def test_beam_search_and_sampled_sequences_match_eager(caplog):
    """Several returned sequences per prompt (the batch expanded to B * n): the same tokens as eager generate, every
    decode layer rewritten. Beam search: HF never auto-compiles it (its loop calls the model itself): the same
    tokens, nothing compiled, and a warning that says so."""
    model = M.deepseek_v3(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    beams = dict(do_sample=False, num_beams=3, num_return_sequences=2)
    sampled = dict(do_sample=True, top_k=4, num_return_sequences=2)
    torch.manual_seed(1)
    refs = [_eager(model, ids, mask, 6, **beams), _eager(model, ids, mask, 6, **sampled)]
    torch._dynamo.reset()
    COUNTERS.clear()
    optimize_generate(model)
    torch.manual_seed(1)
    with torch.no_grad(), caplog.at_level("WARNING", logger=G.__name__):
        outs = [model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, pad_token_id=0, **kw)
                for kw in (beams, sampled)]
    assert outs[0].shape == (4, 12) and torch.equal(outs[0], refs[0])
    assert outs[1].shape == (4, 12) and torch.equal(outs[1], refs[1])
    assert sum("num_beams" in r.getMessage() for r in caplog.records) == 1  # the sampled call: no warning
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2  # the sampled call's decode graph
    assert COUNTERS["mla_compile"].get("mla_attention_not_rewritten", 0) == 0


def test_optimize_generate_wraps_generate_once_and_keeps_a_set_cache_implementation():
    model = M.deepseek_v3(num_layers=1)
    model.generation_config.cache_implementation = "paged"  # whatever the user set stays
    hf_generate = model.generate
    optimize_generate(model)
    first = model.generate
    assert getattr(first, G._DEFERS) and getattr(first, G._WRAPS) == hf_generate
    optimize_generate(model, defer_stop_check=False, masks_in_graph=False)  # re-wraps HF's generate, not ours
    assert getattr(model.generate, G._WRAPS) == hf_generate and not getattr(model.generate, G._DEFERS)
    assert "create_masks_for_generate" not in vars(model)
    assert model.generation_config.cache_implementation == "paged"


def test_optimize_generate_with_a_passed_cache():
    """HF refuses cache_implementation together with a cache: the caller's cache wins over our "static" default."""
    model = M.deepseek_v3(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    ref = _eager(model, ids, mask, 6, do_sample=False)
    torch._dynamo.reset()
    COUNTERS.clear()
    optimize_generate(model)
    cache = MLAPagedCache(model.config, max_cache_len=16, page_size=4, shuffle_pages=True)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                             pad_token_id=0, **cache_kwargs(model, cache))
    assert torch.equal(out, ref)
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 2


def test_deferral_hook_answers_hf_rule_only_inside_a_deferring_generate_on_cuda():
    assert G._install_deferral_hook()
    ask = gen_utils.DeferredStopCheck.is_supported
    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    class Cache:
        is_croppable = False

    class RecordingLayer:  # transformers >= 5.25's linear-attention / sliding layers
        def activate_past_recording(self, **kwargs):
            raise AssertionError("not called by the hook")

    class HybridCache:
        is_croppable = True
        layers = [object(), RecordingLayer()]

    assert ask(cuda, None, False, is_assistant=False) is False  # outside: HF's default (mps only)
    seen = []
    model = M.deepseek_v3(num_layers=1)
    inside = G._wrap_generate(model, lambda: seen.extend([ask(cuda, None, False, is_assistant=False),
                                               ask(cuda, Cache(), True, is_assistant=False),  # HF: not croppable
                                               ask(cuda, Cache(), False, is_assistant=False),
                                               ask(cuda, None, False, is_assistant=True),  # HF: not assistants
                                               ask(cpu, None, False, is_assistant=False),
                                               # handed back: its recording layers would lose their static
                                               # addresses under CUDA graphs; kept by generate(): HF's rule
                                               ask(cuda, HybridCache(), True, is_assistant=False),
                                               ask(cuda, HybridCache(), False, is_assistant=False)]), defer=True)
    inside()
    assert seen == [True, False, True, False, False, False, True]
    assert ask(cuda, None, False, is_assistant=False) is False  # reset after the call
    assert G._install_deferral_hook() and gen_utils.DeferredStopCheck.is_supported is ask  # installed once


def test_optimize_generate_rejects_non_bool_switches():
    model = M.deepseek_v3(num_layers=1)
    with pytest.raises(ValueError, match="defer_stop_check"):
        optimize_generate(model, defer_stop_check="yes")


def test_optimize_generate_applies_a_family_dynamo_config_only_inside_generate():
    """glm5_next's decode step is one graph only when Dynamo captures data-dependent output shapes (its kpool
    indexer; under that config tests/hf/test_hf_families.py proves the rewrite exact); optimize_generate sets it for
    the model's own generate() calls, and nothing for other families."""
    import test_hf_families as F

    assert G.dynamo_config(M.deepseek_v3(num_layers=1)) == {}
    model = F.tiny_model("glm5_next", "sdpa")  # its text model (HF has glm5_next generate() on the VL model only)
    assert G.dynamo_config(model) == {"capture_dynamic_output_shape_ops": True}
    model.generation_config = transformers.GenerationConfig()
    seen = []
    model.generate = lambda *a, **k: seen.append(torch._dynamo.config.capture_dynamic_output_shape_ops)
    before = torch._dynamo.config.capture_dynamic_output_shape_ops
    optimize_generate(model)
    model.generate()
    assert seen == [True] and torch._dynamo.config.capture_dynamic_output_shape_ops == before


def test_generate_raises_the_recompile_limit_only_inside_generate():
    """A graph per batch size (dynamic=False), per DSA graph and per cache class: Dynamo's default limit (8) would
    run a model's ninth decode-step shape eagerly. Inside generate() the limit is at least G.RECOMPILE_LIMIT (a
    higher one set by the user stays); outside, unchanged."""
    model = M.deepseek_v3(num_layers=1)
    seen = []
    model.generate = lambda *a, **k: seen.append(torch._dynamo.config.recompile_limit)
    before = torch._dynamo.config.recompile_limit
    optimize_generate(model)
    model.generate()
    with torch._dynamo.config.patch(recompile_limit=G.RECOMPILE_LIMIT * 2):
        model.generate()
    assert seen == [max(before, G.RECOMPILE_LIMIT), G.RECOMPILE_LIMIT * 2] and G.RECOMPILE_LIMIT > 8
    assert torch._dynamo.config.recompile_limit == before



def _cache_of(out):
    cache = getattr(out, "past_key_values", None)
    return cache if cache is not None else out.cache


def test_reuse_cache_keeps_one_static_cache_across_calls_and_matches_eager():
    """optimize_generate reuses the static cache by default: the second call of the same shapes gets the first
    call's cache back, reset (the same tensors: the CUDA graphs' static addresses stay, so nothing is recorded
    again), with fp32 tokens equal to eager generate's; another batch size gets a new cache. A call that hands its
    cache back (return_dict_in_generate) may take the kept one but never keeps it: a later call neither resets nor
    reuses a cache the caller holds. reuse_cache=False: every call its own cache, as HF does."""
    model = M.deepseek_v3(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    ids3, mask3 = M.batch(B=3, T=5, L=5, pad=1)
    ref, ref3 = _eager(model, ids, mask, 6, do_sample=False), _eager(model, ids3, mask3, 4, do_sample=False)
    torch._dynamo.reset()
    COUNTERS.clear()
    optimize_generate(model)
    prepared = []  # each call's static cache, as HF's generate() receives it
    reusing = model._prepare_static_cache

    def spy(*args, **kwargs):
        prepared.append(reusing(*args, **kwargs))
        return prepared[-1]

    model._prepare_static_cache = spy

    def gen(i, m, new, returns=False):
        with torch.no_grad():
            out = model.generate(i, attention_mask=m, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=0, return_dict_in_generate=returns)
        return (out.sequences, _cache_of(out)) if returns else (out, None)

    first, _ = gen(ids, mask, 6)
    keys = [layer.keys for layer in prepared[-1].layers]
    second, _ = gen(ids, mask, 6)
    assert torch.equal(first, ref) and torch.equal(second, ref)
    assert prepared[1] is prepared[0] and all(layer.keys is k for layer, k in zip(prepared[1].layers, keys))
    handed, held = gen(ids, mask, 6, returns=True)  # takes the kept cache, and the caller keeps it
    assert torch.equal(handed, ref) and held is prepared[0]
    snapshot = [layer.keys.clone() for layer in held.layers]
    assert any(s.abs().sum() > 0 for s in snapshot)
    after, _ = gen(ids, mask, 6)  # a new cache: the caller's is neither reset nor written
    assert torch.equal(after, ref) and prepared[-1] is not held
    assert all(torch.equal(layer.keys, s) for layer, s in zip(held.layers, snapshot))
    gen(ids, mask, 6)
    assert prepared[-1] is prepared[-2]
    third, _ = gen(ids3, mask3, 4)  # another batch size: its own cache (one is held at a time)
    again, _ = gen(ids3, mask3, 4)
    assert torch.equal(third, ref3) and torch.equal(again, ref3)
    assert prepared[-2] is not prepared[0] and prepared[-1] is prepared[-2]
    assert COUNTERS["mla_compile"].get("mla_attention_not_rewritten", 0) == 0
    optimize_generate(model, reuse_cache=False)  # each call builds its own cache, as HF does
    _, c5 = gen(ids3, mask3, 4, returns=True)
    _, c6 = gen(ids3, mask3, 4, returns=True)
    assert c5 is not c6 and c5 is not prepared[-1]
