"""HF MLA models compiled with `backend="mla_dcp"` under DCP and TP x DCP, across real gloo processes (issue 28).

Every rank runs the same greedy decode: single-process eager HF (HF's StaticCache, whole model) is the reference;
the compiled model runs over `MLAPagedCache(dcp=group)`. TP x DCP: `init_dcp(tp_size=2, dcp_size=2)` on 4 ranks and
`shard_mla_heads` (each rank a quarter of the heads, o_proj's partial sums all-reduced): the pass emits
`mla.tp_dcp_decode`. DeepSeek-V3.2 crosses index_topk during the decode, so both DSA graphs run: dense (indexer
dropped) and sparse (`dsa.dcp_indexer_topk` over each rank's key shard + attention over its selected slots); the
sparse graph gathers no key cache. fp32: tokens must be identical to the reference.
"""

from __future__ import annotations

import pytest
import torch

import test_dcp_gloo as base

# its module fixture (a process group pool) runs once: every test here on one xdist worker
# (README's test command: --dist loadgroup)
pytestmark = pytest.mark.xdist_group("test_hf_tp_dcp_gloo")

pytest.importorskip("transformers")

TOPK, PROMPT, STEPS = 8, 5, 9  # kv lengths 6 .. 14: dense graph first, then sparse


@pytest.fixture(scope="module")
def groups():
    yield from base.group_pool(__name__)




def cmd_hf_decode(ctx, kind: str, tp: int, impl: str = "sdpa", empty_row: bool = False):
    """tp 0: pure DCP over the world; tp > 0: TP x DCP with dcp_size = world / tp. empty_row: request 1 is padding
    everywhere (eager HF then attends its whole static cache alike: the flat-softmax rows)."""
    import copy

    import hf_models as M
    from mla_compile.backend import mla_dcp
    from mla_compile.integrations.hf import MLAPagedCache
    from mla_compile.integrations.tp import shard_mla_heads
    from transformers import StaticCache

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    grp = base.worker_group(ctx, tp)
    if kind == "v3":
        model = M.deepseek_v3(num_layers=1, attn_impl=impl, heads=8)
    else:
        model = M.deepseek_v32(num_layers=1, attn_impl=impl, heads=8, index_topk=TOPK)
    L = PROMPT + STEPS + 3
    ids, mask = M.batch(T=PROMPT, L=L)
    if empty_row:
        mask[1] = 0
    ref_t, ref_l = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), STEPS)
    if tp:
        model = shard_mla_heads(copy.deepcopy(model), grp)
    e_t, _ = M.greedy(model, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, dcp=grp), 3)
    graphs = []

    def backend(gm, example_inputs):
        compiled = mla_dcp(gm, example_inputs)
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return compiled

    compiled = torch.compile(model, backend=backend, fullgraph=True)
    c_t, c_l = M.greedy(compiled, model, ids, mask, MLAPagedCache(model.config, L, page_size=4, dcp=grp), STEPS,
                        prefill=model)
    layout = (grp.size, grp.rank, grp.tp_rank, grp.head_shards, grp.head_rank) if tp else None
    return dict(ref_t=ref_t, e_t=e_t, c_t=c_t, err=M.rel_err(c_l, ref_l), graphs=graphs, layout=layout,
                counters=dict(torch._dynamo.utils.counters["mla_compile"]))


COMMANDS = {"hf_decode": cmd_hf_decode}


def _check(res, sparse: bool, tp: bool):
    for r in res:
        assert torch.equal(r["e_t"], r["ref_t"][:, :3]), "eager HF over the sharded cache differs"
        assert torch.equal(r["c_t"], r["ref_t"]), (r["c_t"], r["ref_t"])
        assert r["err"] < 1e-4, r["err"]
        c = r["counters"]
        assert c.get("mla_attention_rewritten", 0) >= 1 and not c.get("mla_attention_not_rewritten"), c
        decode_op = "mla.tp_dcp_decode.default" if tp else "mla.dcp_decode.default"
        other = "mla.dcp_decode.default" if tp else "mla.tp_dcp_decode.default"
        for g in r["graphs"]:
            assert decode_op in g and other not in g, g
            # no gather left: neither the latent's nor (DSA, both graphs) the indexer keys'
            assert "mla_hf.gather_latent.default" not in g, g
        if sparse:
            assert len(r["graphs"]) == 2, len(r["graphs"])  # the dense and the sparse decode graph
            assert c.get("dsa_index_mask_dropped", 0) >= 1 and c.get("dsa_sparse_rewritten", 0) >= 1, c
            dense, sp = r["graphs"]
            assert "dsa.dcp_indexer_topk.default" in sp and "dsa.dcp_indexer_topk.default" not in dense
    assert all(torch.equal(r["c_t"], res[0]["c_t"]) for r in res)


@pytest.mark.parametrize("n,impl,empty_row", [
    (2, "eager", True),  # fast: eager attention with an all-padding row (flat-softmax rows), left padding
    pytest.param(2, "sdpa", False, marks=pytest.mark.slow),  # the same code paths, sdpa's bool mask
    pytest.param(3, "sdpa", False, marks=pytest.mark.slow),  # n = 3: test_dcp_dsa_gloo covers the op at 3 ranks fast
])
def test_dcp_dsa_graphs_match_single_process_hf(groups, n, impl, empty_row):
    _check(groups(n).run("hf_decode", "v32", 0, impl, empty_row, timeout=600), sparse=True, tp=False)


@pytest.mark.parametrize("kind", [pytest.param("v3", marks=pytest.mark.slow), "v32"])  # v32: TP x DCP + both DSA
def test_tp2_x_dcp2_matches_single_process_hf(groups, kind):
    res = groups(4).run("hf_decode", kind, 2, timeout=600)
    # world rank g: DCP rank g % 2 of its group, TP rank g // 2, head block g of 4
    assert [r["layout"] for r in res] == [(2, g % 2, g // 2, 4, g) for g in range(4)]
    _check(res, sparse=kind == "v32", tp=True)


def test_cache_refuses_a_group_that_disagrees_with_the_model():
    import hf_models as M
    from mla_compile.distributed import init_dcp
    from mla_compile.integrations.hf import MLAPagedCache
    from mla_compile.integrations.tp import shard_mla_heads

    grp = init_dcp(tp_size=1)  # one process: TP 1 x DCP 1, heads "split" one way
    model = M.deepseek_v3(num_layers=1, heads=8)
    with pytest.raises(ValueError, match="^dcp: this group splits attention heads"):
        MLAPagedCache(model.config, 16, dcp=grp)
    with pytest.raises(ValueError, match="^group: heads are not sharded"):
        shard_mla_heads(model, init_dcp())
    shard_mla_heads(model, grp)
    with pytest.raises(ValueError, match="^model: its attention heads are sharded already"):
        shard_mla_heads(model, grp)
    with pytest.raises(ValueError, match="^dcp: the model's heads were sharded"):
        MLAPagedCache(model.config, 16, dcp=None)
    MLAPagedCache(model.config, 16, dcp=grp)  # the matching group
