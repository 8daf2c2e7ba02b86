"""Beam search and seeded sampling with our paged cache: HF reorders the cache between steps (`Cache.reorder_cache(beam_idx)`: request
b continues beam beam_idx[b]); HF's static layers index_select their [B, ...] buffers, our layers are page pools,
so they copy pages through the block table, in place. Token-exact against eager HF with its StaticCache, and the
page copy against its definition for every layout (bf16, fused rows, FP8 token buffer, DCP shard with indexer
pages)."""

from __future__ import annotations

import pytest
import torch

import hf_models as M

transformers = pytest.importorskip("transformers")
from mla_compile.integrations.hf import MLAPagedCache, MLAPagedLayer, cache_kwargs  # noqa: E402

BEAMS = dict(do_sample=False, num_beams=3, num_return_sequences=2)


def _generate(model, ids, mask, cache=None):
    extra = cache_kwargs(model, cache) if cache is not None else {"cache_implementation": "static"}
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=8, min_new_tokens=8, pad_token_id=0,
                              disable_compile=True, **BEAMS, **extra)


@pytest.mark.parametrize("fused_rows", [False, True])
def test_beam_search_over_shuffled_pages_matches_hf_static_cache(fused_rows):
    model = M.deepseek_v3(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    ref = _generate(model, ids, mask)
    cache = MLAPagedCache(model.config, max_cache_len=16, page_size=4, shuffle_pages=True, fused_rows=fused_rows)
    out = _generate(model, ids, mask, cache)
    assert out.shape == (4, 14) and torch.equal(out, ref)


def test_seeded_sampling_over_shuffled_pages_matches_hf_static_cache():
    """Several sampled sequences per prompt through a passed paged cache: the same tokens as HF's StaticCache
    under the same seed (the page shuffle draws from a generator of its own, not the global one)."""
    model = M.deepseek_v3(num_layers=2)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    kw = dict(attention_mask=mask, max_new_tokens=8, min_new_tokens=8, pad_token_id=0, disable_compile=True,
              do_sample=True, top_k=4, num_return_sequences=2)
    torch.manual_seed(3)
    with torch.no_grad():
        ref = model.generate(ids, cache_implementation="static", **kw)
        torch.manual_seed(3)
        cache = MLAPagedCache(model.config, max_cache_len=16, page_size=4, shuffle_pages=True)
        out = model.generate(ids, **kw, **cache_kwargs(model, cache))
    assert out.shape == (4, 14) and torch.equal(out, ref)


def test_dsa_beam_search_over_pages_matches_hf_static_cache():
    """V3.2 crossing index_topk: the indexer keys (HF's [B, L, Di] buffer on one rank) are reordered too."""
    model = M.deepseek_v32(num_layers=2, index_topk=8)
    ids, mask = M.batch(B=2, T=6, L=6, pad=2)
    ref = _generate(model, ids, mask)
    out = _generate(model, ids, mask, MLAPagedCache(model.config, max_cache_len=16, page_size=4, shuffle_pages=True))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("variant", ["bf16", "fused_rows", "fp8", "dcp_indexer"])
def test_reorder_copies_each_requests_pages_from_its_beam_in_place(variant):
    B, R, P, Di, PS = 4, 128, 8, 16, 4  # R: FP8 scales cover 128 channels each
    layer = MLAPagedLayer(max_cache_len=11, page_size=PS, shuffle_pages=True, fused_rows=variant == "fused_rows",
                          kv_cache_dtype="fp8_e4m3" if variant == "fp8" else None,
                          dcp_size=2 if variant == "dcp_indexer" else 1)
    layer.lazy_initialization(torch.zeros(B, 1, 1, R, dtype=torch.bfloat16),
                              torch.zeros(B, 1, 1, P, dtype=torch.bfloat16))
    if variant == "dcp_indexer":  # what update_indexer allocates under DCP: indexer keys in the latent's pages
        layer.indexer_keys, layer.is_indexer_initialized = torch.zeros(layer.keys.shape[0], PS, Di), True
    pools = {"keys": layer.keys, "values": layer.values, "indexer_keys": getattr(layer, "indexer_keys", None)}
    pools = {k: v for k, v in pools.items() if v is not None}
    g = torch.Generator().manual_seed(0)
    for pool in pools.values():  # every byte random: a page copied from the wrong place shows
        if pool.dtype == torch.uint8:
            pool.copy_(torch.randint(0, 256, pool.shape, generator=g, dtype=torch.uint8))
        else:
            pool.copy_(torch.randn(pool.shape, generator=g))
    before = {k: v.clone() for k, v in pools.items()}
    addresses = {k: v.data_ptr() for k, v in pools.items()}
    beam_idx = torch.tensor([2, 0, 2, 1])  # request 2's beam kept twice, request 3's dropped
    layer.reorder_cache(beam_idx)
    table = layer.block_table.long()
    for name in pools:
        pool = getattr(layer, name)
        assert pool.data_ptr() == addresses[name], name  # in place: CUDA graphs keep reading the same buffers
        for b in range(B):
            assert torch.equal(pool[table[b]], before[name][table[beam_idx[b]]]), (name, b)
    with pytest.raises(ValueError, match="beam_idx"):
        layer.reorder_cache(torch.tensor([0, 1]))
