"""DSA dense / sparse graphs for compiled HF DeepseekV32 / GlmMoeDsa decode (issue 6).

The caches (`DSAStaticCache`, `MLAPagedCache`) keep a host-side int `max_kv_len` and compare it with
`config.index_topk` in `update_indexer`, so Dynamo guards on it and compiles exactly two decode graphs:
dense (kv_len <= topk: no indexer logits / top-k, the `all_selected` marker lets the pass drop the index
mask) and sparse (HF's indexer logits / top-k / index mask -> `dsa.indexer_topk` over the indexer key cache,
attention -> `mla.sparse_decode` over the selected slots). V3.2 and GLM-DSA, sdpa and eager, HF's static cache
and our paged one, and a GLM "shared" indexer layer.
One decode loop per model crosses topk after a few steps and then runs 200 steps under
`set_stance("fail_on_recompile")`; tokens equal eager HF (HF's own StaticCache), logits within 1e-4.
Regenerate the snapshots with `EXPECTTEST_ACCEPT=1 pytest tests/hf/test_hf_dsa_graphs.py`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import expecttest
import pytest
import torch
import torch.fx as fx

import hf_models as M
import mla_compile  # noqa: F401
from mla_compile.backend import mla_dcp

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache, cache_kwargs  # noqa: E402

TOPK = 16
PROMPT = 5
WARMUP = 16  # max_kv_len 6 .. 21: both variants compiled by then
STEPS = WARMUP + 200
TOL = 1e-4
COUNTERS = torch._dynamo.utils.counters
ROOT = Path(__file__).resolve().parents[2]


class Recorder:
    """mla_dcp, keeping each Dynamo graph as the pass left it and what Inductor was handed."""

    def __init__(self):
        self.graphs, self.inductor_inputs = [], []

    def __call__(self, gm, example_inputs):
        import torch._inductor.compile_fx as cfx

        original = cfx.compile_fx

        def spy(g, inputs, **kw):  # compile_fx re-enters itself to apply config patches: record the outer call
            cfx.compile_fx = original
            self.inductor_inputs.append(list(inputs))
            self.graphs.append(g)
            return original(g, inputs, **kw)

        cfx.compile_fx = spy
        try:
            return mla_dcp(gm, example_inputs)
        finally:
            cfx.compile_fx = original


def dsa_model(kind: str, *, num_layers: int = 1, index_topk: int = TOPK, attn_impl: str = "sdpa",
              indexer_types=None, seed: int = 0):
    """The tests' DSA model with V3.2 / GLM-5's 64 indexer heads (mla_compile.models' default). With few heads
    a token's index score is exactly 0 whenever q.k <= 0 in every head (relu), and such exact ties at the
    top-k boundary are broken differently by HF's torch.topk and `dsa.indexer_topk` (both valid top-k sets,
    different logits: seen with 4 heads). 64 heads make exact ties practically impossible, so tokens can be
    compared with eager HF exactly."""
    if kind == "v32":
        return M.deepseek_v32(num_layers=num_layers, index_topk=index_topk, attn_impl=attn_impl, seed=seed)
    return M.glm_moe_dsa(num_layers=num_layers, index_topk=index_topk, attn_impl=attn_impl, seed=seed,
                         indexer_types=indexer_types)


def _decode_loop(build, impl, cache_fn, **model_kw):
    torch._dynamo.reset()
    COUNTERS.clear()
    model = build(attn_impl=impl, **model_kw)
    L = PROMPT + STEPS + 1
    ids, mask = M.batch(T=PROMPT, L=L)
    rec = Recorder()
    compiled = torch.compile(model, backend=rec, fullgraph=True)
    ref_cache, cache = StaticCache(config=model.config, max_cache_len=L), cache_fn(model.config, L)
    toks, ref_toks, logits, ref_logits, kv_lens = [], [], [], [], []
    with torch.no_grad():
        for c in (ref_cache, cache):  # prefill: eager HF
            out = model(ids, attention_mask=mask[:, :PROMPT], **cache_kwargs(model, c), cache_position=torch.arange(PROMPT))
        tok = ref_tok = out.logits[:, -1].argmax(-1)
        try:
            for i in range(STEPS):
                if i == WARMUP:
                    assert len(rec.graphs) == 2, f"{len(rec.graphs)} graphs after warm-up"
                    torch.compiler.set_stance("fail_on_recompile")
                pos = torch.tensor([PROMPT + i])
                kv_lens.append(cache.max_kv_len)
                out = compiled(tok[:, None], attention_mask=mask, **cache_kwargs(model, cache), cache_position=pos)
                ref = model(ref_tok[:, None], attention_mask=mask, **cache_kwargs(model, ref_cache),
                            cache_position=pos)
                logits.append(out.logits[:, -1].float())
                ref_logits.append(ref.logits[:, -1].float())
                tok, ref_tok = out.logits[:, -1].argmax(-1), ref.logits[:, -1].argmax(-1)
                toks.append(tok)
                ref_toks.append(ref_tok)
        finally:
            torch.compiler.set_stance("default")
    result = dict(graphs=rec.graphs, inductor_inputs=rec.inductor_inputs, kv_lens=kv_lens,
                  toks=torch.stack(toks, 1), ref_toks=torch.stack(ref_toks, 1), logits=torch.stack(logits, 1),
                  ref_logits=torch.stack(ref_logits, 1), counters=dict(COUNTERS["mla_compile"]),
                  unique_graphs=COUNTERS["stats"]["unique_graphs"], final_len=cache.max_kv_len)
    torch._dynamo.reset()
    return result


# ------------------------------------------------------------------------------------------ stable text
def attention_ops(gm: fx.GraphModule) -> str:
    """The op nodes of the attention layer (indexer included) from the latent cache write to the attention
    output, `target -> shape`, one per line (projections before the cache write are left out)."""
    region = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
              and any("self_attn" in str(v) for v in (n.meta.get("nn_module_stack") or {}).values())]
    start = next(i for i, n in enumerate(region) if n.target == "index_copy_")
    end = max(i for i, n in enumerate(region) if isinstance(n.target, torch._ops.OpOverload)
              or n.target is torch._C._nn.scaled_dot_product_attention)
    lines = []
    for n in region[start:end + 1]:
        v = n.meta.get("example_value")
        shape = f" -> {list(v.shape)} {str(v.dtype).replace('torch.', '')}" if isinstance(v, torch.Tensor) else ""
        lines.append(f"{M.node_target(n)}{shape}")
    return "\n".join(lines)


def _ops(gm) -> set:
    return {M.node_target(n) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}


# ----------------------------------------------------------------------------------------------- tests
LOOPS = {}


LOOP_SPECS = {  # name: (model kind, attention, cache, model kwargs)
    "v32-sdpa-static": ("v32", "sdpa", "static", {}),
    "glm-eager-paged": ("glm", "eager", "paged", {}),
    "v32-eager-paged": ("v32", "eager", "paged", {}),
    "glm-sdpa-static-shared": ("glm", "sdpa", "static", dict(num_layers=2, indexer_types=["full", "shared"])),
}


def _loop(name):
    if name not in LOOPS:
        kind, impl, cache, kw = LOOP_SPECS[name]
        cache_fn = ((lambda cfg, L: DSAStaticCache(cfg, L)) if cache == "static"
                    else (lambda cfg, L: MLAPagedCache(cfg, L, page_size=8)))
        LOOPS[name] = _decode_loop(lambda **k: dsa_model(kind, **k), impl, cache_fn, **kw)
    return LOOPS[name]


@pytest.fixture(autouse=True)
def _stance():
    yield
    torch.compiler.set_stance("default")


@pytest.mark.parametrize("name", list(LOOP_SPECS))
def test_two_graphs_match_eager_hf(name):
    r = _loop(name)
    layers = LOOP_SPECS[name][3].get("num_layers", 1)
    assert min(r["kv_lens"]) <= TOPK < max(r["kv_lens"])
    assert r["final_len"] == PROMPT + STEPS + 1
    assert len(r["graphs"]) == 2 and r["unique_graphs"] == 2
    assert torch.equal(r["toks"], r["ref_toks"])
    assert M.rel_err(r["logits"], r["ref_logits"]) < TOL
    assert r["counters"]["mla_attention_rewritten"] == 2 * layers  # one site per layer per graph
    assert r["counters"]["dsa_index_mask_dropped"] == layers  # the dense graph's
    assert r["counters"]["dsa_sparse_rewritten"] == layers  # the sparse graph's
    # no Python int reaches Inductor (CUDA-graph trees would re-record per value)
    for inputs in r["inductor_inputs"]:
        assert all(isinstance(x, torch.Tensor) for x in inputs), [type(x).__name__ for x in inputs]
    dense, sparse = (_ops(g) for g in r["graphs"])
    for op in (".topk", "torch.relu", "torch.nn.functional.relu", ".scatter", "mla_hf.all_selected.default"):
        assert op not in dense, op
        assert op not in sparse, op  # HF's indexer logits / top-k / index mask -> dsa.indexer_topk
    assert "mla.decode.default" in dense
    # sdpa: the sparse graph attends through mla.sparse_decode alone. Eager: HF's finfo.min mask gives a request
    # whose mask row is all False a flat softmax over every cache slot, more than k slots can list, so the eager
    # sparse graph also carries one mla.decode for such rows (empty on every other row; passes/mla_attention.py)
    assert ("mla.decode.default" not in sparse) == (LOOP_SPECS[name][1] == "sdpa")
    assert "dsa.indexer_topk.default" not in dense and "dsa.indexer_topk.default" in sparse
    assert "mla.sparse_decode.default" in sparse
    # a GLM "shared" layer reuses the previous layer's selection: one indexer call per graph
    assert sum(n.target is torch.ops.dsa.indexer_topk.default for n in r["graphs"][1].graph.nodes) == 1
    assert ".index_copy_" in dense and ".index_copy_" in sparse  # the indexer key-cache write stays


def test_eager_cache_is_hf():
    """Eagerly DSAStaticCache is HF's StaticCache (bit-equal logits) and counts tokens on the host."""
    model = M.deepseek_v32(num_layers=2, index_topk=8, attn_impl="sdpa")
    ids, mask = M.batch(L=24)
    a = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=24), 12)
    cache = DSAStaticCache(model.config, 24)
    b = M.greedy(model, model, ids, mask, cache, 12)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert cache.max_kv_len == ids.shape[1] + 12 + 1
    cache.reset()
    assert cache.max_kv_len == 1


def test_guards_name_the_topk_comparison():
    code = (
        "import sys; sys.path.insert(0, 'tests'); import torch, hf_models as M, mla_compile\n"
        "from mla_compile.integrations.hf import DSAStaticCache\n"
        "m = M.deepseek_v32(num_layers=1, index_topk=8, attn_impl='sdpa'); ids, mask = M.batch(L=20)\n"
        "M.greedy(torch.compile(m, backend='mla_dcp', fullgraph=True), m, ids, mask, DSAStaticCache(m.config, 20), "
        "6, prefill=m)\n"
    )
    env = {**os.environ, "TORCH_LOGS": "guards"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cache = r"L\['kwargs'\]\['(?:past_key_values|cache)'\]"  # the kwarg's name: 'cache' from transformers 5.24
    assert re.search(cache + r"\.max_kv_len <= 8", proc.stderr)
    assert re.search(r"9 <= " + cache + r"\.max_kv_len", proc.stderr)


class TestSnapshots(expecttest.TestCase):
    def test_dense_graph(self):
        dense = attention_ops(_loop("v32-sdpa-static")["graphs"][0])
        self.assertExpectedInline(dense, """\
.index_copy_ -> [2, 1, 222, 512] float32
.index_copy_ -> [2, 1, 222, 64] float32
torch.cat -> [2, 4, 1, 192] float32
torch._C._nn.linear -> [2, 1, 128] float32
torch.nn.functional.layer_norm -> [2, 1, 128] float32
.unsqueeze -> [2, 1, 1, 128] float32
torch.functional.split
_operator.getitem -> [2, 1, 1, 64] float32
_operator.getitem -> [2, 1, 1, 64] float32
.unsqueeze -> [1, 1, 1, 64] float32
.unsqueeze -> [1, 1, 1, 64] float32
_operator.mul -> [2, 1, 1, 64] float32
_operator.getitem -> [2, 1, 1, 32] float32
_operator.getitem -> [2, 1, 1, 32] float32
_operator.neg -> [2, 1, 1, 32] float32
torch.cat -> [2, 1, 1, 64] float32
_operator.mul -> [2, 1, 1, 64] float32
_operator.add -> [2, 1, 1, 64] float32
torch.cat -> [2, 1, 1, 128] float32
.squeeze -> [2, 1, 128] float32
torch.arange -> [1] int64
_operator.add -> [1] int64
.add_ -> [] int64
.index_copy_ -> [2, 222, 128] float32
aten.select.int -> [2, 4, 128] float32
aten.select.int -> [2, 4, 64] float32
aten.reshape.default -> [4, 256, 512] float32
aten.slice.Tensor -> [4, 128, 512] float32
aten.slice.Tensor -> [4, 128, 512] float32
aten.transpose.int -> [4, 2, 128] float32
aten.bmm.default -> [4, 2, 512] float32
aten.transpose.int -> [2, 4, 512] float32
aten.expand.default -> [2, 1, 1, 222] bool
aten.reshape.default -> [2, 222] bool
aten.cumsum.default -> [2, 222] int64
aten.select.int -> [2] int64
aten._to_copy.default -> [2] int32
aten.sub.Tensor -> [2, 222] int64
aten.where.ScalarOther -> [2, 222] int64
aten.arange.default -> [222] int32
aten.expand.default -> [2, 222] int32
aten.zeros.default -> [2, 223] int32
aten.scatter.src -> [2, 223] int32
aten.slice.Tensor -> [2, 222] int32
aten.arange.start_step -> [2] int32
aten.unsqueeze.default -> [2, 1] int32
aten.add.Tensor -> [2, 222] int32
aten.reshape.default -> [444, 1, 512] float32
aten.reshape.default -> [444, 1, 64] float32
mla.decode.default
_operator.getitem -> [2, 4, 512] float32
aten.transpose.int -> [4, 2, 512] float32
aten.transpose.int -> [4, 512, 128] float32
aten.bmm.default -> [4, 2, 128] float32
aten.transpose.int -> [2, 4, 128] float32
aten.unsqueeze.default -> [2, 4, 1, 128] float32""")

    def test_sparse_graph(self):
        sparse = attention_ops(_loop("v32-sdpa-static")["graphs"][1])
        self.assertExpectedInline(sparse, """\
.index_copy_ -> [2, 1, 222, 512] float32
.index_copy_ -> [2, 1, 222, 64] float32
torch.cat -> [2, 4, 1, 192] float32
torch._C._nn.linear -> [2, 1, 8192] float32
.view -> [2, 1, 64, 128] float32
torch.functional.split
_operator.getitem -> [2, 1, 64, 64] float32
_operator.getitem -> [2, 1, 64, 64] float32
torch._C._nn.linear -> [2, 1, 128] float32
torch.nn.functional.layer_norm -> [2, 1, 128] float32
.unsqueeze -> [2, 1, 1, 128] float32
torch.functional.split
_operator.getitem -> [2, 1, 1, 64] float32
_operator.getitem -> [2, 1, 1, 64] float32
.unsqueeze -> [1, 1, 1, 64] float32
.unsqueeze -> [1, 1, 1, 64] float32
_operator.mul -> [2, 1, 64, 64] float32
_operator.getitem -> [2, 1, 64, 32] float32
_operator.getitem -> [2, 1, 64, 32] float32
_operator.neg -> [2, 1, 64, 32] float32
torch.cat -> [2, 1, 64, 64] float32
_operator.mul -> [2, 1, 64, 64] float32
_operator.add -> [2, 1, 64, 64] float32
_operator.mul -> [2, 1, 1, 64] float32
_operator.getitem -> [2, 1, 1, 32] float32
_operator.getitem -> [2, 1, 1, 32] float32
_operator.neg -> [2, 1, 1, 32] float32
torch.cat -> [2, 1, 1, 64] float32
_operator.mul -> [2, 1, 1, 64] float32
_operator.add -> [2, 1, 1, 64] float32
torch.cat -> [2, 1, 64, 128] float32
torch.cat -> [2, 1, 1, 128] float32
.squeeze -> [2, 1, 128] float32
torch.arange -> [1] int64
_operator.add -> [1] int64
.add_ -> [] int64
.index_copy_ -> [2, 222, 128] float32
.to -> [2, 1, 64] float32
torch._C._nn.linear -> [2, 1, 64] float32
.float -> [2, 1, 64] float32
_operator.mul -> [2, 1, 64] float32
aten.select.int -> [2, 4, 128] float32
aten.select.int -> [2, 4, 64] float32
aten.reshape.default -> [4, 256, 512] float32
aten.slice.Tensor -> [4, 128, 512] float32
aten.slice.Tensor -> [4, 128, 512] float32
aten.transpose.int -> [4, 2, 128] float32
aten.bmm.default -> [4, 2, 512] float32
aten.transpose.int -> [2, 4, 512] float32
aten.expand.default -> [2, 1, 1, 222] bool
aten.reshape.default -> [2, 222] bool
aten.cumsum.default -> [2, 222] int64
aten.select.int -> [2] int64
aten._to_copy.default -> [2] int32
aten.sub.Tensor -> [2, 222] int64
aten.where.ScalarOther -> [2, 222] int64
aten.arange.default -> [222] int32
aten.expand.default -> [2, 222] int32
aten.zeros.default -> [2, 223] int32
aten.scatter.src -> [2, 223] int32
aten.slice.Tensor -> [2, 222] int32
aten.arange.start_step -> [2] int32
aten.unsqueeze.default -> [2, 1] int32
aten.add.Tensor -> [2, 222] int32
aten.reshape.default -> [444, 1, 128] float32
aten.reshape.default -> [2, 64, 128] float32
aten.reshape.default -> [2, 64] float32
dsa.indexer_topk.default -> [2, 16] int32
aten.reshape.default -> [444, 1, 512] float32
aten.reshape.default -> [444, 1, 64] float32
mla.sparse_decode.default
_operator.getitem -> [2, 4, 512] float32
aten.transpose.int -> [4, 2, 512] float32
aten.transpose.int -> [4, 512, 128] float32
aten.bmm.default -> [4, 2, 128] float32
aten.transpose.int -> [2, 4, 128] float32
aten.unsqueeze.default -> [2, 4, 1, 128] float32""")
