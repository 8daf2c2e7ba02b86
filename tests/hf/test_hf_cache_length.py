"""Our caches' host-side token count (integrations/hf.py, DSADenseMixin): a step past `max_cache_len` raises
(eagerly and compiled: never a token silently dropped), and the DSA dense / sparse choice moves with the count
whichever layers have an indexer (a last layer without one, e.g. sliding-window or linear, must not freeze it).
A cache's batch size, fixed by its first write, is checked by name too."""

from __future__ import annotations

import pytest
import torch

import hf_models as M
from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache, cache_kwargs

pytest.importorskip("transformers")


@pytest.mark.parametrize("compiled", [None, False, True], ids=["eager", "compiled", "fullgraph"])
@pytest.mark.parametrize("kind", ["paged", "dsa_static"])
def test_step_past_max_cache_len_raises(compiled, kind):
    torch._dynamo.reset()
    model = M.deepseek_v3(num_layers=1) if kind == "paged" else M.deepseek_v32(num_layers=1, index_topk=4)
    L = 8
    cache = (MLAPagedCache(model.config, max_cache_len=L, page_size=4) if kind == "paged"
             else DSAStaticCache(model.config, max_cache_len=L))
    ids, mask = M.batch(B=2, T=5, L=L, pad=1)
    step = model if compiled is None else torch.compile(model, backend="mla_dcp", fullgraph=compiled)
    # fullgraph: Dynamo reports a raise inside the compiled region as Unsupported("Observed exception"), its
    # message holding ours; otherwise our ValueError itself
    error = Exception if compiled else ValueError
    with torch.no_grad():
        model(ids, attention_mask=mask[:, :5], **cache_kwargs(model, cache), cache_position=torch.arange(5))
        tok = ids[:, :1]
        for t in range(5, L):  # positions 5, 6, 7 fit
            step(tok, attention_mask=mask, **cache_kwargs(model, cache), cache_position=torch.tensor([t]))
        with pytest.raises(error, match="max_cache_len=8"):
            step(tok, attention_mask=torch.ones(2, L + 1, dtype=mask.dtype), **cache_kwargs(model, cache),
                 cache_position=torch.tensor([L]))


def _dots3(topk: int):
    from transformers.models.dots3_note.configuration_dots3_note import Dots3NoteTextConfig
    from transformers.models.dots3_note.modeling_dots3_note import Dots3NoteForCausalLM

    from mla_compile.models import MLA_DIMS, spread_weights

    cfg = Dots3NoteTextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96, index_topk=topk, index_n_heads=64,
        index_head_dim=128, layer_types=["indexed_attention", "sliding_attention"], sliding_window=64,
        mlp_layer_types=["dense", "dense"], max_position_embeddings=512, pad_token_id=0, bos_token_id=0,
        eos_token_id=None, attn_implementation="sdpa", **MLA_DIMS)
    return spread_weights(Dots3NoteForCausalLM(cfg), 0, torch.float32)


def test_dsa_count_moves_when_the_last_layer_has_no_indexer():
    pytest.importorskip("transformers.models.dots3_note")
    topk, T, steps, L = 8, 5, 8, 16
    model = _dots3(topk)
    ids, mask = M.batch(B=2, T=T, L=L, pad=1)
    ref_t, ref_l = M.greedy(model, model, ids, mask, DSAStaticCache(model.config, max_cache_len=L), steps)
    torch._dynamo.reset()
    cache = DSAStaticCache(model.config, max_cache_len=L)
    step = torch.compile(model, backend="mla_dcp", fullgraph=True)
    toks, logits = M.greedy(step, model, ids, mask, cache, steps, prefill=model)
    assert cache.max_kv_len == T + steps + 1  # tokens cached + 1: it moved every step
    assert torch.equal(toks, ref_t)
    assert M.rel_err(logits, ref_l) < 1e-4


@pytest.mark.parametrize("kind", ["paged", "dsa_static"])
@pytest.mark.parametrize("B", [1, 3])
def test_cache_refuses_another_batch_size_by_name(B, kind):
    """The first write sizes the pages and block table for its batch; a later call with another batch size (after
    reset(), as HF's StaticCache would be reused) is a ValueError naming key_states and both sizes, not an index
    error or a shape mismatch deep in the attention."""
    if kind == "paged":
        model = M.deepseek_v3(num_layers=1)
        cache = MLAPagedCache(model.config, max_cache_len=16, page_size=4)
    else:
        model = M.deepseek_v32(num_layers=1)
        cache = DSAStaticCache(model.config, max_cache_len=16)
    kw = dict(max_new_tokens=2, pad_token_id=0, do_sample=False, disable_compile=True)
    with torch.no_grad():
        model.generate(*M.batch(B=2, T=5, L=5, pad=1)[:1], **kw, **cache_kwargs(model, cache))
        cache.reset()
        ids, mask = M.batch(B=B, T=5, L=5, pad=1)
        with pytest.raises(ValueError, match=f"key_states: batch size {B}, but this cache was allocated for batch "
                                             f"size 2"):
            model.generate(ids, attention_mask=mask, **kw, **cache_kwargs(model, cache))
