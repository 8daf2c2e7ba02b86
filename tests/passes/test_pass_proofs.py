"""What the attention pass must prove before it rewrites a site (issue 22 items 3, 4, 7).

- Masks: only hard masks become a token table (SDPA bool masks; additive where / masked_fill with 0 and
  constants <= -1e30). A bool tensor ADDED to eager scores shifts them by +1 / +0 and is not a mask.
- Fully masked rows: the rewrite gives what HF's softmax gives (0, NaN, or a flat softmax over the whole cache).
- Writes: nothing may write memory the rewrite reads (latent, rope latent, kv_b_proj's weight, the mask's inputs)
  between where HF read it and the attention, through any view, slice, reshape or aliased input.

Every case runs the function eagerly (the reference, on its own copy of the inputs) and compiled with `mla_dcp`,
and checks both the rewrite count and the values (fp32: 1e-4 relative, fp64: 1e-10).
"""

from __future__ import annotations

import logging
import operator

import pytest
import torch
import torch.fx as fx

import hf_models as M
import mla_compile  # noqa: F401
from mla_compile.passes import _fx, attention_mask, mla_attention

transformers = pytest.importorskip("transformers")
from transformers import StaticCache  # noqa: E402

COUNTERS = torch._dynamo.utils.counters
TOL = {torch.float32: 1e-4, torch.float64: 1e-10}
LOGGER = "mla_compile.passes.mla_attention"

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


def _run(fn, args, *, rewritten: int, dense: int = 0):
    """(compiled output, eager output) of fn on separate copies of args; checks the rewrite counts (`rewritten`:
    into the decode ops, `dense`: absorbed with HF's own mask, `passes/attention_dense.py`)."""
    ref = fn(*[a.clone() for a in args])
    out = torch.compile(fn, backend="mla_dcp", fullgraph=True)(*[a.clone() for a in args])
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.COUNTER] == rewritten and c[mla_attention.DENSE_COUNTER] == dense, dict(c)
    assert c[mla_attention.SKIP_COUNTER] == 1 - rewritten - dense, dict(c)
    return out, ref


def _close(out, ref, dtype, equal_nan=False):
    if equal_nan:
        assert torch.equal(out.isnan(), ref.isnan())
        out, ref = out.nan_to_num(0.0), ref.nan_to_num(0.0)
    assert M.rel_err(out, ref) < TOL[dtype]


# --------------------------------------------------------------------------------------- which masks
def _mask(kind: str, valid: torch.Tensor, dtype: torch.dtype):
    lo = torch.finfo(dtype).min
    if kind == "bool":
        return valid
    if kind == "where-min":  # HF eager
        return torch.where(valid, torch.zeros((), dtype=dtype), lo)
    if kind == "where-inverted":
        return torch.where(~valid, lo, torch.zeros((), dtype=dtype))
    if kind == "where-neginf":
        return torch.where(valid, torch.zeros((), dtype=dtype), float("-inf"))
    if kind == "where-min-fill-min":  # DSA eager: + masked_fill(index_mask, min)
        return torch.where(valid, torch.zeros((), dtype=dtype), lo).masked_fill(
            torch.arange(valid.shape[-1]) % 5 == 3, lo)
    if kind == "where-small":  # -1e4 does not zero a probability next to scores of -1e4 .. 1e4: not a mask
        return torch.where(valid, torch.zeros((), dtype=dtype), -1e4)
    if kind == "mixed-constants":  # an empty row would attend only the min-masked entries
        return torch.where(valid, torch.zeros((), dtype=dtype), lo).masked_fill(
            torch.arange(valid.shape[-1]) % 5 == 3, float("-inf"))
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_bool_added_to_eager_scores_is_not_a_mask(dtype, caplog):
    """softmax(q.k^T * s + bool): the bool shifts the scores by +1 / +0 (HF eager with a user's 4-D bool mask). Not
    a mask for the decode ops; the absorbed form with HF's own mask adds it as HF does."""
    q, latent, kpe, w, valid = M.synthetic_site_inputs(dtype=dtype)

    def fn(q, latent, kpe, w, valid):
        return M.mla_attention_site(q, latent, kpe, w, valid, impl="eager")

    with caplog.at_level(logging.INFO, logger=LOGGER):
        out, ref = _run(fn, (q, latent, kpe, w, valid), rewritten=0, dense=1)
    assert "bool tensor added to the scores" in caplog.text
    _close(out, ref, dtype)
    # the hard-mask reading of it (what a token table computes) is far from HF's answer
    hard = M.mla_attention_site(q, latent, kpe, w, _mask("where-min", valid, dtype), impl="eager")
    assert M.rel_err(hard, ref) > 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("impl,kind", [("sdpa", "bool"), ("eager", "where-min"), ("eager", "where-inverted"),
                                       ("eager", "where-neginf"), ("eager", "where-min-fill-min"),
                                       ("sdpa", "where-min"), ("sdpa", "where-neginf")])
def test_proven_masks_are_rewritten(impl, kind, dtype):
    q, latent, kpe, w, valid = M.synthetic_site_inputs(dtype=dtype)

    def fn(q, latent, kpe, w, valid):
        return M.mla_attention_site(q, latent, kpe, w, _mask(kind, valid, q.dtype), impl=impl)

    out, ref = _run(fn, (q, latent, kpe, w, valid), rewritten=1)
    _close(out, ref, dtype)


@pytest.mark.parametrize("impl,kind,reason", [("eager", "where-small", "not provably 0 / -inf"),
                                              ("sdpa", "where-small", "not provably 0 / -inf"),
                                              ("eager", "mixed-constants", "different constants")])
def test_unproven_masks_keep_their_values(impl, kind, reason, caplog):
    """A mask the decode ops cannot read as valid tokens: the site is absorbed with the mask as it is (the reason
    the decode ops could not take it logged)."""
    q, latent, kpe, w, valid = M.synthetic_site_inputs()

    def fn(q, latent, kpe, w, valid):
        return M.mla_attention_site(q, latent, kpe, w, _mask(kind, valid, q.dtype), impl=impl)

    with caplog.at_level(logging.INFO, logger=LOGGER):
        out, ref = _run(fn, (q, latent, kpe, w, valid), rewritten=0, dense=1)
    assert reason in caplog.text
    _close(out, ref, torch.float32)


def test_mask_constants_are_realized_in_the_mask_dtype():
    """-1e30 stored in a float16 mask is -inf: with an empty row, eager then gives NaN, not a flat softmax."""
    g = fx.Graph()
    cond = g.placeholder("cond")
    cond.meta["example_value"] = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
    m = g.call_function(torch.where, (cond, 0.0, -1e30))
    m.meta["example_value"] = torch.zeros(2, 1, 1, 8, dtype=torch.float16)
    assert attention_mask.prove_mask(m, additive=True).empty_rows == attention_mask.EMPTY_NAN
    m.meta["example_value"] = torch.zeros(2, 1, 1, 8, dtype=torch.float32)
    assert attention_mask.prove_mask(m, additive=True).empty_rows == attention_mask.EMPTY_UNIFORM
    assert attention_mask.prove_mask(m, additive=True, dtypes=(torch.float16,)).empty_rows == attention_mask.EMPTY_NAN
    # a float64 mask's finfo.min through HF's float32 softmax: -inf
    m.meta["example_value"] = torch.zeros(2, 1, 1, 8, dtype=torch.float64)
    m.args = (cond, 0.0, torch.finfo(torch.float64).min)
    assert attention_mask.prove_mask(m, additive=True).empty_rows == attention_mask.EMPTY_UNIFORM
    proof = attention_mask.prove_mask(m, additive=True, dtypes=(torch.float64, torch.float32))
    assert proof.empty_rows == attention_mask.EMPTY_NAN


# ------------------------------------------------------------------------------------ fully masked rows
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("impl,kind,hf_gives", [("eager", "where-min", "uniform"), ("eager", "where-neginf", "nan"),
                                                ("eager", "where-min-fill-min", "uniform"), ("sdpa", "bool", "zero"),
                                                ("sdpa", "where-min", "uniform"), ("sdpa", "where-neginf", "zero")])
def test_fully_masked_row_matches_hf(impl, kind, hf_gives, dtype):
    q, latent, kpe, w, valid = M.synthetic_site_inputs(dtype=dtype)
    valid[1] = False  # a request with no valid token

    def fn(q, latent, kpe, w, valid):
        return M.mla_attention_site(q, latent, kpe, w, _mask(kind, valid, q.dtype), impl=impl)

    out, ref = _run(fn, (q, latent, kpe, w, valid), rewritten=1)
    # what HF's math gives that row (so the comparison below tests the case it claims to)
    B, _, L, _ = latent.shape
    v = torch.nn.functional.linear(latent, w).view(B, L, -1, 256).transpose(1, 2)[..., 128:]
    row = ref[1]
    if hf_gives == "uniform":
        assert M.rel_err(row, v[1].mean(-2, keepdim=True)) < TOL[dtype]
    elif hf_gives == "nan":
        assert row.isnan().all()
    else:
        assert torch.equal(row, torch.zeros_like(row))
    _close(out, ref, dtype, equal_nan=hf_gives == "nan")


def test_fully_masked_row_long_cache():
    """Rows longer than the scan chunk (1024), one of them masked everywhere (eager, finfo.min)."""
    q, latent, kpe, w, valid = M.synthetic_site_inputs(B=3, H=2, L=2500)
    valid[2] = False

    def fn(q, latent, kpe, w, valid):
        return M.mla_attention_site(q, latent, kpe, w, _mask("where-min", valid, q.dtype), impl="eager")

    out, ref = _run(fn, (q, latent, kpe, w, valid), rewritten=1)
    _close(out, ref, torch.float32)


def _sink_site(q, latent, kpe, w, mask, sinks):
    """hy_v4's eager attention written out: softmax over [scores + mask | per-head sink] (minus the row max), the
    sink's column dropped."""
    B, _, L, _ = latent.shape
    kv = torch.nn.functional.linear(latent, w).view(B, L, -1, 256).transpose(1, 2)
    k_nope, v = torch.split(kv, [128, 128], dim=-1)
    k = torch.cat([k_nope, kpe.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
    s = torch.matmul(q, k.transpose(2, 3)) * 0.07 + mask
    c = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(B, -1, 1, -1)], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    p = torch.nn.functional.softmax(c, dim=-1, dtype=c.dtype)[..., :-1]
    return torch.matmul(p.to(v.dtype), v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["where-min", "where-neginf", "where-min-fill-min"])
def test_attention_sinks_are_rewritten(kind, dtype):
    """softmax([s | z])[..., :-1] @ V = (softmax(s) @ V) * sigmoid(lse(s) - z) per head, emitted after mla.decode
    from its lse; a request with no valid token attends only the sink (0, whatever its mask constant)."""
    q, latent, kpe, w, valid = M.synthetic_site_inputs(dtype=dtype)
    valid[1] = False
    sinks = torch.linspace(-2.0, 3.0, q.shape[1], dtype=dtype)  # from "sink negligible" to "sink dominates"

    def fn(q, latent, kpe, w, valid, sinks):
        return _sink_site(q, latent, kpe, w, _mask(kind, valid, q.dtype), sinks)

    out, ref = _run(fn, (q, latent, kpe, w, valid, sinks), rewritten=1)
    assert torch.equal(ref[1], torch.zeros_like(ref[1]))
    plain = M.mla_attention_site(q, latent, kpe, w, _mask(kind, valid, dtype), impl="eager")
    assert M.rel_err(ref[0], plain[0]) > 1e-2  # the sinks matter here (the test tells them apart)
    _close(out, ref, dtype)


def _empty_request_batch(L):
    """A left-padded batch whose second request is padding everywhere (its mask row all False)."""
    ids, mask = M.batch(B=3, L=L)
    mask[1] = 0
    return ids, mask


@pytest.mark.parametrize("impl,dtype,cache", [("eager", torch.float32, "static"), ("eager", torch.float64, "static"),
                                              ("sdpa", torch.float32, "static"), ("eager", torch.float32, "paged")])
def test_hf_fully_masked_request_matches_eager(impl, dtype, cache):
    from mla_compile.integrations.hf import MLAPagedCache

    model = M.deepseek_v3(num_layers=1, attn_impl=impl, dtype=dtype)
    L = 24
    ids, mask = _empty_request_batch(L)

    def cache_fn():
        if cache == "paged":
            return MLAPagedCache(model.config, L, page_size=8, shuffle_pages=True)
        return StaticCache(config=model.config, max_cache_len=L)

    ref_t, ref_l = M.greedy(model, model, ids, mask, cache_fn(), 6)
    if impl == "eager" and dtype == torch.float32:  # HF: the empty request attends the whole cache alike (not 0)
        assert ref_l[1].isfinite().all() and ref_l[1].abs().max() > 0
    if dtype == torch.float64:  # HF's float32 softmax turns finfo(float64).min into -inf: the row is NaN
        assert ref_l[1].isnan().all() and ref_l[[0, 2]].isfinite().all()
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    t, logits = M.greedy(compiled, model, ids, mask, cache_fn(), 6, prefill=model)
    assert torch.equal(t, ref_t)
    assert torch.equal(logits.isnan(), ref_l.isnan())
    tol = 1e-6 if dtype == torch.float64 else TOL[dtype]  # HF's softmax runs in float32
    assert M.rel_err(logits.nan_to_num(0.0), ref_l.nan_to_num(0.0)) < tol
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 1


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_dsa_sparse_fully_masked_request_matches_eager(impl):
    """V3.2 past index_topk (sparse graph: dsa.indexer_topk + mla.sparse_decode) with an empty request: eager HF
    attends its whole cache alike, which the k-wide sparse op cannot list (a second decode covers that row)."""
    from mla_compile.integrations.hf import DSAStaticCache

    model = M.deepseek_v32(num_layers=1, index_topk=4, attn_impl=impl)
    L = 16
    ids, mask = _empty_request_batch(L)
    ref_t, ref_l = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 6)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    t, logits = M.greedy(compiled, model, ids, mask, DSAStaticCache(model.config, L), 6, prefill=model)
    assert torch.equal(t, ref_t)
    assert M.rel_err(logits, ref_l) < TOL[torch.float32]
    assert COUNTERS["mla_compile"]["dsa_sparse_rewritten"] == 1


def test_hf_eager_user_bool_mask_is_left_alone():
    """HF eager with a user's 4-D bool mask adds it to the scores; the compiled model must do the same (not
    rewritten), while sdpa with the same mask is a real mask and is rewritten."""
    L, T = 24, 5
    ids, mask = M.batch(L=L)
    for impl, rewritten in (("eager", 0), ("sdpa", 1)):
        torch._dynamo.reset()
        COUNTERS.clear()
        model = M.deepseek_v3(num_layers=1, attn_impl=impl)
        caches = [StaticCache(config=model.config, max_cache_len=L) for _ in range(2)]
        compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
        with torch.no_grad():
            for c in caches:
                tok = model(ids, attention_mask=mask[:, :T], **M.cache_kwargs(model, c)).logits[:, -1].argmax(-1)
            for i in range(4):
                kw = dict(attention_mask=M.step_masks(mask, T + i), cache_position=torch.tensor([T + i]))
                ref = model(tok[:, None], **M.cache_kwargs(model, caches[0]), **kw).logits[:, -1]
                out = compiled(tok[:, None], **M.cache_kwargs(model, caches[1]), **kw).logits[:, -1]
                assert M.rel_err(out, ref) < TOL[torch.float32], (impl, i)
                tok = ref.argmax(-1)
        assert COUNTERS["mla_compile"][mla_attention.COUNTER] == rewritten, impl


# --------------------------------------------------------------------------------- writes in the window
def _writes(kind):
    """(between(tensors) -> None, rewritten): a write between the expansion and the attention."""
    return {
        "latent slice copy_": (lambda t: t["latent"][:, :, 3].copy_(t["other"][:, :, 0]), 0),
        "latent setitem": (lambda t: t["latent"].__setitem__(Ellipsis, 0.5), 0),
        "latent view fill_": (lambda t: t["latent"].view(-1)[:4].fill_(3.0), 0),
        "latent += (augmented)": (lambda t: operator.iadd(t["latent"][0], 1.0), 0),
        "kpe reshape add_": (lambda t: t["kpe"].reshape(-1)[:10].add_(1.0), 0),
        "kv_b_proj weight mul_": (lambda t: t["w"].mul_(2.0), 0),
        "weight row via transpose": (lambda t: t["w"].t()[0].zero_(), 0),
        "mask input after where": (lambda t: t["valid"].fill_(True), 0),
        "aliased input": (lambda t: t["alias"][1].fill_(7.0), 0),
        "unrelated tensor": (lambda t: t["other"].mul_(3.0), 1),
        "query before the attention reads it": (lambda t: t["q"].mul_(0.5), 1),
    }[kind]


WRITES = ["latent slice copy_", "latent setitem", "latent view fill_", "latent += (augmented)", "kpe reshape add_",
          "kv_b_proj weight mul_", "weight row via transpose", "mask input after where", "aliased input",
          "unrelated tensor", "query before the attention reads it"]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("kind", WRITES)
def test_write_in_the_window_leaves_the_site_alone(kind, impl, caplog):
    q, latent, kpe, w, valid = M.synthetic_site_inputs()
    other = torch.randn(latent.shape)
    write, rewritten = _writes(kind)

    def fn(q, latent, kpe, w, valid, other, alias):
        mask = torch.where(valid, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        if impl == "sdpa":
            mask = mask.masked_fill(torch.arange(valid.shape[-1]) % 5 == 3, torch.finfo(q.dtype).min)
        t = dict(q=q, latent=latent, kpe=kpe, w=w, valid=valid, other=other, alias=alias)
        return M.mla_attention_site(q, latent, kpe, w, mask, impl=impl, between=lambda: write(t))

    ref_args = [a.clone() for a in (q, latent, kpe, w, valid, other)]
    ref = fn(*ref_args, ref_args[1].view(latent.shape[0], -1))
    args = [a.clone() for a in (q, latent, kpe, w, valid, other)]
    compiled = torch.compile(fn, backend="mla_dcp", fullgraph=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        out = compiled(*args, args[1].view(latent.shape[0], -1))  # alias: the latent's storage again
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == rewritten, caplog.text
    if not rewritten:
        assert "writes memory that" in caplog.text
    _close(out, ref, torch.float32)


def test_hf_kv_b_proj_weight_written_after_the_expansion(monkeypatch):
    """An attention that scales kv_b_proj's weight in place after expanding the cache (HF read the old weight):
    left alone. Two identical models drift alike, eager and compiled."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mod

    expand = mod.DeepseekV3Attention.expand_kv

    def expand_then_write(self, kv_nope, k_rot):
        key, value = expand(self, kv_nope, k_rot)
        self.kv_b_proj.weight.mul_(1.01)
        return key, value

    monkeypatch.setattr(mod.DeepseekV3Attention, "expand_kv", expand_then_write)
    L = 24
    ids, mask = M.batch(L=L)
    twin = M.deepseek_v3(num_layers=1)
    ref = M.greedy(twin, twin, ids, mask, StaticCache(config=twin.config, max_cache_len=L), 4)
    model = M.deepseek_v3(num_layers=1)
    compiled = torch.compile(model, backend="mla_dcp", fullgraph=True)
    out = M.greedy(compiled, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), 4, prefill=model)
    assert torch.equal(out[0], ref[0]) and M.rel_err(out[1], ref[1]) < TOL[torch.float32]
    assert COUNTERS["mla_compile"][mla_attention.COUNTER] == 0
    assert COUNTERS["mla_compile"][mla_attention.SKIP_COUNTER] >= 1


# ----------------------------------------------------------------------------------- the shared predicates
def _node(g, target, *args, op="call_function", **kwargs):
    return g.create_node(op, target, args, kwargs)


def test_written_by_covers_every_way_of_writing():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    cases = {
        _node(g, "add_", x, y, op="call_method"): [x],
        _node(g, "__setitem__", x, 0, y, op="call_method"): [x],
        _node(g, operator.setitem, x, (Ellipsis, 0), y): [x],
        _node(g, operator.iadd, x, y): [x],
        _node(g, torch.relu_, x): [x],
        _node(g, torch.nn.functional.relu, x, inplace=True): [x],
        _node(g, torch.nn.functional.relu, x, True): [x],
        _node(g, torch.add, x, y, out=y): [y],
        _node(g, torch.ops.aten.copy_.default, x, y): [x],
        _node(g, torch.ops.aten.index_put_, x, [y], y): [x],
        _node(g, operator.and_, x, y): [],
        _node(g, torch.add, x, y): [],
        _node(g, "view", x, -1, op="call_method"): [],
        _node(g, torch.nn.functional.relu, x): [],
    }
    for n, expect in cases.items():
        assert _fx.written_by(n) == expect, (n.target, n.args, n.kwargs)
    assert _fx.is_pure(_node(g, operator.and_, x, y)) and not _fx.is_pure(_node(g, operator.iand, x, y))


def test_first_write_follows_storage_through_views():
    """On a Dynamo graph (fake values keep storage sharing): a write through a view of a reshape of x is a write
    to x; a write to a copy of x (a reshape that cannot be a view) is not."""
    seen = {}

    def backend(gm, example_inputs):
        seen["gm"] = gm
        return gm.forward

    def f(x, y):
        r = x * 2
        x.t().reshape(-1)[0:3].fill_(1.0)  # a copy: x is untouched
        y.view(-1)[2:5].zero_()
        return r + x.sum() + y.sum()

    torch.compile(f, backend=backend, fullgraph=True)(torch.randn(4, 6), torch.randn(4, 6))
    graph = seen["gm"].graph
    nodes = list(graph.nodes)
    x, y = nodes[0], nodes[1]
    read = next(n for n in nodes if n.op == "call_function" and n.target is operator.mul)
    end = next(n for n in nodes if n.op == "output")
    assert _fx.first_write(graph, {x: read}, end) is None
    writer, r = _fx.first_write(graph, {x: read, y: read}, end)
    assert r is y and writer.target == "zero_"
