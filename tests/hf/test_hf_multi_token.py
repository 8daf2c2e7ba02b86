"""HF steps with several query tokens per request (speculative verification: `generate(assistant_model=...)`,
`generate(prompt_lookup_num_tokens=...)`) through the `mla_dcp` backend: fp32 tokens equal eager generate's, the
verification steps are rewritten (passes/attention_tokens.py), caches roll back (`crop`), DCP over gloo ranks
equals single-rank eager, and what cannot be proven stays HF attention (counted)."""

from __future__ import annotations


import pytest
import torch

import hf_models as M
from mla_compile.integrations.hf import (DSAStaticCache, MLAPagedCache, cache_kwargs, compile_config,
                                         create_masks_in_graph)
from mla_compile.ops import dcp_consistency as agree
from mla_compile.passes import mla_attention
from mla_compile.passes.step_kind import multi_token_attention

pytest.importorskip("transformers")
COUNTERS = torch._dynamo.utils.counters
NEW = 10




def _generate(model, ids, compiled: bool, cache=None, new: int = NEW, **kw):
    extra = {} if cache is None else cache_kwargs(model, cache)
    if compiled:
        extra["compile_config"] = compile_config(mode="default")
    else:
        extra["disable_compile"] = True
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=0,
                              cache_implementation=None if cache is not None else "static", **extra, **kw)


def _draft():
    # another tiny model as the assistant: its drafts are mostly rejected (crop after most steps)
    return M.deepseek_v3(num_layers=1, seed=7)


def _assistant_kw(draft, n: int = 3):
    draft.generation_config.num_assistant_tokens = n
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    return dict(assistant_model=draft)


def _prompt(T=12):
    """A prompt with repeated n-grams (prompt lookup finds drafts in it)."""
    base = torch.randint(1, 120, (1, 4), generator=torch.Generator().manual_seed(5))
    return base.repeat(1, T // 4)


def _assert_rewritten(layers: int):
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.TOKENS_COUNTER] >= layers, dict(c)  # at least one verification graph, every layer
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)


@pytest.mark.parametrize("impl", ["sdpa", pytest.param("eager", marks=pytest.mark.slow)])
def test_assisted_generation_matches_eager(impl):
    """HF static cache, the mask built in the graph: every verification step (S = 2 .. 4) rewritten. (Eager
    attention's emission is also checked fast, one step, in test_eager_step_with_empty_rows_matches_hf.)"""
    model = M.deepseek_v3(num_layers=1, attn_impl=impl)
    model.create_masks_for_generate = create_masks_in_graph
    ids = _prompt()
    draft = _draft()
    ref = _generate(model, ids, compiled=False, **_assistant_kw(draft))
    M.fresh(model)
    out = _generate(model, ids, compiled=True, **_assistant_kw(draft))
    assert torch.equal(out, ref), (out, ref)
    _assert_rewritten(1)


def test_compiled_forward_specializes_each_draft_length(fresh_dynamo):
    """`model.forward = torch.compile(model.forward, backend="mla_dcp")` under Dynamo's default (automatic dynamic
    shapes) with assisted generation: the draft length changes between steps, so Dynamo makes S symbolic; the pass
    specializes it (S <= 8: a verification step) and rewrites each length's graph; tokens equal eager generate()'s."""
    from transformers import StaticCache

    model = M.deepseek_v3(num_layers=1)
    model.create_masks_for_generate = create_masks_in_graph
    ids = _prompt()
    draft = _draft()
    kw = dict(disable_compile=True, **_assistant_kw(draft, 4))

    def run():
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + 24)
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                                  do_sample=False, pad_token_id=0, **cache_kwargs(model, cache), **kw)

    ref = run()
    model.forward = torch.compile(model.forward, backend="mla_dcp")
    assert torch.equal(run(), ref)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.SPECIALIZED_COUNTER] >= 1 and c[mla_attention.TOKENS_COUNTER] >= 1, dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 1, dict(c)  # the prefill (12 query tokens: HF attention)


def test_prompt_lookup_with_paged_cache_matches_eager():
    """Our paged cache: HF crops it after rejected drafts (device length and host max_kv_len move back)."""
    model = M.deepseek_v3(num_layers=1)
    model.create_masks_for_generate = create_masks_in_graph
    ids = _prompt()
    # HF sizes its own static cache at max_length, and a last draft may reach past it: caches with room
    from transformers import StaticCache

    # a random model soon repeats itself: 20 new tokens give prompt lookup n-grams to draft from
    ref = _generate(model, ids, compiled=False, prompt_lookup_num_tokens=2, new=20,
                    cache=StaticCache(config=model.config, max_cache_len=ids.shape[1] + 24))
    M.fresh(model)
    cache = MLAPagedCache(model.config, max_cache_len=ids.shape[1] + 24, page_size=4, shuffle_pages=True)
    out = _generate(model, ids, compiled=True, cache=cache, prompt_lookup_num_tokens=2, new=20)
    assert torch.equal(out, ref), (out, ref)
    _assert_rewritten(1)


@pytest.mark.slow  # test_non_prefix_mask_is_not_rewritten covers a graph-input multi-token mask fast
def test_precomputed_graph_input_mask_is_left_to_hf():
    """generate()'s default road hands the compiled step HF's precomputed 4-D mask: its values are not in the
    graph, so nothing proves its rows causal; the verification sites stay HF attention (counted), tokens exact."""
    model = M.deepseek_v3(num_layers=1)
    ids = _prompt()
    draft = _draft()
    ref = _generate(model, ids, compiled=False, **_assistant_kw(draft))
    M.fresh(model)
    out = _generate(model, ids, compiled=True, **_assistant_kw(draft))
    assert torch.equal(out, ref)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.SKIP_COUNTER] >= 1 and c[mla_attention.TOKENS_COUNTER] == 0, dict(c)


# ------------------------------------------------------------------------------------------------ the proof
def _captured_step(model, mask4d=None, S=3, L=16):
    """The Dynamo graph of an S-token step over a prefilled HF static cache (no Inductor: fast)."""
    from transformers import StaticCache

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    ids, mask = M.batch(B=2, T=5, L=L)
    cache = StaticCache(config=model.config, max_cache_len=L)
    torch._dynamo.reset()  # earlier tests' graphs of the same forward count against the recompile limit
    with torch.no_grad():
        model(ids, attention_mask=mask[:, :5], **cache_kwargs(model, cache))
        step = torch.compile(model, backend=capture, fullgraph=True, dynamic=False)
        new = torch.randint(1, 100, (2, S), generator=torch.Generator().manual_seed(S))
        step(new, attention_mask=mask if mask4d is None else mask4d, **cache_kwargs(model, cache))
    return graphs[-1]


def test_step_kind_tells_verification_from_prefill():
    """A verification step reads the cache it is given: CUDA graphs stay on (tests/hf/test_hf_generate.py's prefill
    test: a prefill that allocates the cache, even of 5 tokens, keeps them off)."""
    model = M.deepseek_v3(num_layers=1)
    assert multi_token_attention(_captured_step(model, S=3)) is None
    assert multi_token_attention(_captured_step(model, S=8)) is None
    assert multi_token_attention(_captured_step(model, S=9, L=20)) is not None  # more than MAX_QUERY_TOKENS


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_in_graph_causal_mask_is_proven(impl):
    model = M.deepseek_v3(num_layers=1, attn_impl=impl)
    COUNTERS.clear()
    assert mla_attention.rewrite_mla_attention(_captured_step(model, S=3)) == 1
    assert COUNTERS["mla_compile"][mla_attention.TOKENS_COUNTER] == 1


def test_non_prefix_mask_is_not_rewritten():
    """A tree-shaped 4-D mask (query token 2 does not see token 1's position): not a prefix of the last row; given
    as a graph input, nothing proves it either way: not for the decode ops, absorbed with the mask as it is."""
    model = M.deepseek_v3(num_layers=1)
    L = 16
    tree = (torch.arange(L) <= torch.tensor([5, 6, 7])[:, None]).expand(2, 1, 3, L).clone()
    tree[:, :, 2, 6] = False
    COUNTERS.clear()
    assert mla_attention.rewrite_mla_attention(_captured_step(model, tree, S=3, L=L)) == 1
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.COUNTER] == 0 and c[mla_attention.DENSE_COUNTER] == 1 and c[mla_attention.SKIP_COUNTER] == 0


def _rewrite_only(gm, example_inputs):
    """A backend that runs the attention rewrite and then the FX graph as it is (the ops' CPU impls; no Inductor)."""
    mla_attention.rewrite_mla_attention(gm)
    return gm.forward


@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_step_with_empty_rows_matches_hf(impl, kind):
    """One 3-token step whose request 1 has its first query token at a padding position (that row sees nothing:
    SDPA gives 0, HF eager a flat softmax over the whole cache), the others causal over left padding: logits equal
    HF's (float32 rounding), the site rewritten."""
    from transformers import StaticCache

    L = 16
    model = M.deepseek_v3(num_layers=1, attn_impl=impl)
    ids, mask = M.batch(B=2, T=5, L=L)
    mask[1, :6] = 0
    new = torch.randint(1, 100, (2, 3), generator=torch.Generator().manual_seed(0))
    logits = []
    torch._dynamo.reset()  # earlier tests' graphs of the same forward count against the recompile limit
    for step in (model, torch.compile(model, backend=_rewrite_only, fullgraph=True, dynamic=False)):
        cache = StaticCache(config=model.config, max_cache_len=L) if kind == "static" else \
            MLAPagedCache(model.config, L, page_size=4, shuffle_pages=True)
        COUNTERS.clear()
        with torch.no_grad():
            model(ids, attention_mask=mask[:, :5], **cache_kwargs(model, cache))
            logits.append(step(new, attention_mask=mask, **cache_kwargs(model, cache)).logits)
    assert COUNTERS["mla_compile"][mla_attention.TOKENS_COUNTER] == 1
    assert M.rel_err(logits[1], logits[0]) < 1e-5


# ------------------------------------------------------------------------------------------------ caches
@pytest.mark.parametrize("kind", ["paged", "dsa_static"])
def test_crop_moves_the_host_count_back(kind):
    """HF's crop(-n) after rejected drafts: the device length and max_kv_len (the overflow check, the DSA
    dense / sparse choice) move back together; a crop past the start keeps the count at its floor."""
    model = M.deepseek_v32(num_layers=1, index_topk=8) if kind == "dsa_static" else M.deepseek_v3(num_layers=1)
    cache = (DSAStaticCache(model.config, max_cache_len=16) if kind == "dsa_static"
             else MLAPagedCache(model.config, 16, page_size=4))
    ids, mask = M.batch(B=1, T=5, L=16, pad=0)
    with torch.no_grad():
        model(ids, attention_mask=mask[:, :5], **cache_kwargs(model, cache))
        model(ids[:, :4], attention_mask=mask[:, :9], **cache_kwargs(model, cache))
    assert cache.max_kv_len == 10 and int(cache.get_seq_length()) == 9
    cache.crop(-3)
    assert cache.max_kv_len == 7 and int(cache.get_seq_length()) == 6
    with pytest.raises(RuntimeError):
        cache.crop(2)  # HF's static layers take only the drop-the-last-n form


# ------------------------------------------------------------------------------------------------ consistency
def test_signature_carries_query_tokens():
    """(S 2, H 16) and (S 1, H 32) gather the same bytes; the header tells them apart, as it does lengths [B]
    from per-query-token limits [B, S]."""
    q2, q1 = torch.zeros(3, 32, 8), torch.zeros(3, 32, 8)
    pe = torch.zeros(3, 32, 4)
    a = agree.signature(None, agree.OP_DCP, q2, pe, 0.5, 2, True, tokens=2)
    b = agree.signature(None, agree.OP_DCP, q1, pe, 0.5, 2, True, tokens=1)
    assert a.payload_numel() == b.payload_numel() and a.fields() != b.fields()
    with pytest.raises(ValueError, match="query tokens per request"):
        agree.check_headers([agree._header(agree.DATA, a.fields()), agree._header(agree.DATA, b.fields())], "g")
    c = agree.signature(None, agree.OP_DCP, q2, pe, 0.5, 2, True, tokens=2, lens=torch.zeros(3, 2, dtype=torch.int32))
    assert c.lens_words == 6 and a.lens_words == 3
    with pytest.raises(ValueError, match="seq_lens form"):
        agree.check_headers([agree._header(agree.DATA, a.fields()), agree._header(agree.DATA, c.fields())], "g")


def test_rows_ok_compares_every_limit_of_a_request():
    """Per-query-token limits [B, S] in the trailer: a request whose limits differ on any rank, in any query
    token, is not merged; the others are."""
    sig = agree.Signature(agree.OP_DCP, 2, 3, 8, 4, 2, torch.float32, 0.5, True, 2, True)
    header = agree.data_header(sig, torch.zeros(1))
    lims = torch.tensor([[4, 5], [6, 7], [0, 0]], dtype=torch.int32)
    other = lims.clone()
    other[1, 1] = 8
    trails = torch.stack([agree.trailer(lims, header), agree.trailer(other, header)])
    assert agree.rows_ok(trails, header, 3, True, sig.lens_words).tolist() == [True, False, True]
    assert agree.rows_ok(trails, header, 3, False, sig.lens_words).tolist() == [True, True, True]


# ------------------------------------------------------------------------------------------------ DCP
def dcp_assisted_worker(rank: int, world: int, init_file: str, result_dir: str) -> None:
    """One DCP rank (gloo, CPU): single-rank eager assisted generation (HF static cache) vs compiled assisted
    generation over the DCP-sharded paged cache (mla.dcp_decode with per-query-token limits)."""
    import types

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        import mla_compile  # noqa: F401

        dcp = types.SimpleNamespace(size=world, rank=rank, group_name=dist.group.WORLD.group_name)
        model = M.deepseek_v3(num_layers=1)
        model.create_masks_for_generate = create_masks_in_graph
        ids = _prompt()
        draft = _draft()
        ref = _generate(model, ids, compiled=False, **_assistant_kw(draft, 2))
        M.fresh(model)
        cache = MLAPagedCache(model.config, ids.shape[1] + NEW + 4, page_size=4, dcp=dcp)
        out = _generate(model, ids, compiled=True, cache=cache, **_assistant_kw(draft, 2))
        torch.save(dict(ref=ref, out=out, counters=dict(COUNTERS["mla_compile"])), f"{result_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_dcp_assisted_generation_matches_single_rank_eager(world, tmp_path):
    import torch.multiprocessing as mp

    mp.spawn(dcp_assisted_worker, args=(world, str(tmp_path / "init"), str(tmp_path)), nprocs=world, join=True)
    for r in range(world):
        res = torch.load(tmp_path / f"rank{r}.pt")
        assert torch.equal(res["out"], res["ref"]), (r, res["out"], res["ref"])
        assert res["counters"].get(mla_attention.TOKENS_COUNTER, 0) >= 1, res["counters"]
        assert res["counters"].get(mla_attention.SKIP_COUNTER, 0) == 0, res["counters"]
