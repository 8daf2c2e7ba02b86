"""Rope-less MLA (qk_rope_head_dim P = 0: glm5_next, mistral_large4's `no_rope_layers`) in every op path.

- the CUDA dispatch decision (`kernels.dispatch`): P = 0 goes to the Triton kernels as a zero rope column of
  width 1 (FlashInfer skipped), exactly the P = 0 result; checked on CPU with the kernels replaced by recorders,
- the Triton kernels themselves through that route under TRITON_INTERPRET=1 (one child process),
- gradients of decode / sparse_decode at P = 0 (float64 gradcheck),
- dcp_decode and tp_dcp_decode at P = 0 across 2 gloo ranks vs the float64 reference,
- a tiny HF mistral_large4 with a NoPE layer and a rope layer: compiled (backend="mla_dcp") decode vs eager HF.
The ops' own P = 0 cases (reference, fuzz, opcheck) live with the other cases in test_ops_reference.py and
test_ops_opcheck.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch

import mla_compile  # noqa: F401
import reference as ref
import tree
from mla_compile.kernels import dispatch

B, H, R, PS = 3, 4, 16, 4
LENS = [9, 0, 5]


def _problem(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    _, (c, k), bt, sl, _ = ref.build_paged(LENS, PS, (R, 0), dtype, generator=g, extra_cols=1)
    q = torch.randn(B, H, R, generator=g).to(dtype)
    return q, torch.zeros(B, H, 0, dtype=dtype), c, k, bt, sl


def _sparse_indices(bt):
    rows = [ref.request_slots(bt, PS, b, n)[::2] for b, n in enumerate(LENS)]
    K = max(map(len, rows))
    return torch.tensor([r + [-1] * (K - len(r)) for r in rows], dtype=torch.int32)


# ================================================================================ the CUDA dispatch decision
class Recorder:
    def __init__(self, result=None):
        self.calls, self.result = [], result

    def __call__(self, *args):
        self.calls.append(args)
        return self.result


class PlanRecorder(Recorder):
    """Stands in for kernels/decode.py's `decode_plan` / `sparse_decode_plan`: records what each plan was made
    with (`made`: args, keywords) and is the plan and its `run` itself (its calls: the tensors each run is handed)."""

    def __init__(self, result=None):
        super().__init__(result)
        self.made = []
        self.run = self

    def make(self, *args, **kwargs):
        self.made.append((args, kwargs))
        return self


def _assert_zero_rope(t, lead):
    assert t.shape == (*lead, 1) and t.stride() == (0,) * len(lead) + (1,)
    assert t.untyped_storage().nbytes() == t.element_size()  # one element, whatever the rows
    assert not t.any()


def test_dispatch_sends_rope_less_decode_to_triton_with_a_zero_rope_column(monkeypatch):
    q, qp, c, k, bt, sl = _problem()
    triton, flashinfer = PlanRecorder(("out", "lse")), Recorder()
    monkeypatch.setattr(dispatch._decode, "decode_plan", triton.make)
    monkeypatch.setattr(dispatch._fi, "decode", flashinfer)
    monkeypatch.setattr(dispatch._fi, "usable", lambda *a: True)
    monkeypatch.setenv("MLA_COMPILE_DECODE_BACKEND", "flashinfer")  # asked for, but built for P = 64 only
    assert dispatch.decode(q, qp, c, k, bt, sl, 0.3) == ("out", "lse")
    assert not flashinfer.calls and len(triton.calls) == 1
    qn2, qp2, c2, k2, bt2, sl2, ckv_scale = triton.calls[0]
    assert qn2 is q and c2 is c and bt2 is bt and sl2 is sl and ckv_scale is None
    assert triton.made[0][0][6] == 0.3  # sm_scale, fixed when the plan is made
    _assert_zero_rope(qp2, (B, H))
    _assert_zero_rope(k2, c.shape[:2])
    # what the kernel is handed is exactly the P = 0 attention (the definition, on CPU)
    want = torch.ops.mla.decode(q, qp, c, k, bt, sl, 0.3)
    got = torch.ops.mla.decode(q, qp2.contiguous(), c, k2.contiguous(), bt, sl, 0.3)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    # P > 0 is untouched: FlashInfer where asked for and usable
    qp4, k4 = torch.randn(B, H, 4), torch.randn(*c.shape[:2], 4)
    dispatch.decode(q, qp4, c, k4, bt, sl, 0.3)
    assert len(flashinfer.calls) == 1 and flashinfer.calls[0][1] is qp4 and flashinfer.calls[0][3] is k4


def test_dispatch_sends_rope_less_sparse_decode_with_a_zero_rope_column(monkeypatch):
    q, qp, c, k, bt, _ = _problem(1)
    idx = _sparse_indices(bt)
    triton = PlanRecorder(("out", "lse"))
    monkeypatch.setattr(dispatch._decode, "sparse_decode_plan", triton.make)
    dispatch.sparse_decode(q, qp, c, k, idx, 0.4)
    qn2, qp2, c2, k2, idx2, sl2, _ = triton.calls[0]
    assert qn2 is q and c2 is c and idx2 is idx and sl2 is None
    assert triton.made[0][0][5] == 0.4
    _assert_zero_rope(qp2, (B, H))
    _assert_zero_rope(k2, c.shape[:2])
    want = torch.ops.mla.sparse_decode(q, qp, c, k, idx, 0.4)
    got = torch.ops.mla.sparse_decode(q, qp2.contiguous(), c, k2.contiguous(), idx, 0.4)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    qp4, k4 = torch.randn(B, H, 4), torch.randn(*c.shape[:2], 4)
    dispatch.sparse_decode(q, qp4, c, k4, idx, 0.4)
    assert triton.calls[1][1] is qp4 and triton.calls[1][3] is k4


def test_dispatch_rope_less_cache_write_writes_the_latent_only(monkeypatch):
    kernel = Recorder()
    monkeypatch.setattr(dispatch._cache, "cache_write", kernel)
    c, k = torch.zeros(3, PS, R), torch.zeros(3, PS, 0)
    ckv, kpe, slots = torch.randn(5, R), torch.zeros(5, 0), torch.tensor([0, -1, 7, 3, 11])
    dispatch.cache_write(c, k, ckv, kpe, slots)
    c2, k2, ckv2, kpe2, slots2 = kernel.calls[0]
    assert c2 is c and ckv2 is ckv and slots2 is slots
    _assert_zero_rope(k2, c.shape[:2])
    _assert_zero_rope(kpe2, (5,))
    assert k2.data_ptr() == kpe2.data_ptr()  # the kernel copies the zero onto itself: nothing else is touched
    k4, kpe4 = torch.zeros(3, PS, 4), torch.randn(5, 4)
    dispatch.cache_write(c, k4, ckv, kpe4, slots)
    assert kernel.calls[1][1] is k4 and kernel.calls[1][3] is kpe4


# ================================================================================ the kernels (interpreter)
def test_triton_kernels_through_the_rope_less_route_under_the_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=tree.child_pythonpath())
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VERDICT ")]
    assert lines, f"interpreter child failed (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    verdict = json.loads(lines[-1][len("VERDICT "):])
    assert verdict == {"decode": "ok", "sparse_decode": "ok", "cache_write": "ok"}, verdict


def _interpreter_child():
    import traceback

    import test_triton_interpret as T

    T._patch_interpreter_for_numpy2()
    torch.set_num_threads(1)
    verdict = {}

    def decode():
        for heads, ps in ((3, 1), (3, 4), (64, 64)):  # few heads; many heads at page 64 (TMA / Gluon otherwise)
            g = torch.Generator().manual_seed(heads + ps)
            _, (c, k), bt, sl, _ = ref.build_paged([70, 0, 5], ps, (32, 0), generator=g, extra_cols=1)
            q = torch.randn(3, heads, 32, generator=g)
            qp = torch.zeros(3, heads, 0)
            out, lse = dispatch.decode(q, qp, c, k, bt, sl, 0.3)
            T._check_attention(out, lse, *ref.ref_decode(q, qp, c, k, bt, sl, 0.3), 1e-5)

    def sparse_decode():
        q, qp, c, k, bt, _ = _problem(2)
        idx = _sparse_indices(bt)
        out, lse = dispatch.sparse_decode(q, qp, c, k, idx, 0.4)
        T._check_attention(out, lse, *ref.ref_sparse_decode(q, qp, c, k, idx, 0.4), 1e-5)

    def cache_write():
        c, k = torch.full((4, 3, 20), math.nan), torch.zeros(4, 3, 0)
        ckv, kpe, slots = torch.randn(5, 20), torch.zeros(5, 0), torch.tensor([0, -1, 7, 3, 11])
        want, _ = ref.ref_cache_write(c, k, ckv, kpe, slots)
        dispatch.cache_write(c, k, ckv, kpe, slots)
        assert torch.allclose(c, want, rtol=0, atol=0, equal_nan=True)

    for name, check in (("decode", decode), ("sparse_decode", sparse_decode), ("cache_write", cache_write)):
        try:
            check()
            verdict[name] = "ok"
        except Exception:  # report every check
            verdict[name] = traceback.format_exc(limit=6)
    print("VERDICT " + json.dumps(verdict), flush=True)


# ================================================================================ gradients
def test_gradients_at_p0_match_finite_differences():
    from test_autograd import finite_lse

    g = torch.Generator().manual_seed(3)  # small: gradcheck perturbs every element of every input
    lens = [4, 0, 3]
    _, (c, k), bt, sl, _ = ref.build_paged(lens, 2, (5, 0), torch.float64, generator=g, extra_cols=1)
    q, qp = torch.randn(3, 2, 5, generator=g, dtype=torch.float64), torch.zeros(3, 2, 0, dtype=torch.float64)
    rows = [ref.request_slots(bt, 2, b, n)[::2] for b, n in enumerate(lens)]
    idx = torch.tensor([r + [-1] * (2 - len(r)) for r in rows], dtype=torch.int32)
    leaves = [t.detach().clone().requires_grad_() for t in (q, qp, c, k)]
    assert torch.autograd.gradcheck(finite_lse(lambda *a: torch.ops.mla.decode(*a, bt, sl, 0.3)), leaves)
    assert torch.autograd.gradcheck(finite_lse(lambda *a: torch.ops.mla.sparse_decode(*a, idx, 0.3)), leaves)
    out, lse = torch.ops.mla.decode(*leaves, bt, sl, 0.3)
    (out.sum() + lse[torch.isfinite(lse)].sum()).backward()
    assert leaves[1].grad.shape == (3, 2, 0) and leaves[3].grad.shape == c.shape[:2] + (0,)


# ================================================================================ DCP across gloo ranks
def cmd_rope_less_dcp(ctx, seed: int):
    """dcp_decode (all heads) and tp_dcp_decode (this rank's heads) at P = 0 vs float64 over the whole cache."""
    from mla_compile import paged

    import test_dcp_gloo as base

    n, rank, hl = ctx.n, ctx.rank, 2
    g = torch.Generator().manual_seed(seed)
    lens = [0, 1, n, 3 * n + 1, 17]
    ckv = [torch.randn(L, R, generator=g) for L in lens]
    kpe = [torch.zeros(L, 0) for L in lens]
    q, qp = torch.randn(len(lens), n * hl, R, generator=g), torch.zeros(len(lens), n * hl, 0)
    full = paged.fill_paged(ckv, kpe, PS, generator=torch.Generator().manual_seed(seed + 1))
    sh = paged.fill_sharded(ckv, kpe, PS, n, rank, generator=torch.Generator().manual_seed(seed + 2 + rank))
    seq, scale = torch.tensor(lens, dtype=torch.int32), R ** -0.5
    o64, l64 = ref.ref_decode(q, qp, full.ckv_cache, full.kpe_cache, full.block_table, seq, scale)
    out, lse = torch.ops.mla.dcp_decode(q, qp, sh.ckv_cache, sh.kpe_cache, sh.block_table, seq, scale, n, rank,
                                        ctx.group_name)
    base._close(out, o64, torch.float32, "dcp out")
    base._close_lse(lse, l64, "dcp lse")
    mine = slice(rank * hl, (rank + 1) * hl)
    out, lse = torch.ops.mla.tp_dcp_decode(q[:, mine].contiguous(), qp[:, mine].contiguous(), sh.ckv_cache,
                                           sh.kpe_cache, sh.block_table, seq, scale, n, rank, ctx.group_name)
    base._close(out, o64[:, mine], torch.float32, "tp out")
    base._close_lse(lse, l64[:, mine], "tp lse")
    return "ok"


COMMANDS = {"rope_less_dcp": cmd_rope_less_dcp}


def test_dcp_and_tp_dcp_decode_at_p0_across_two_ranks():
    import test_dcp_gloo as base

    group = base.GlooGroup(2, commands=__name__)
    try:
        assert group.run("rope_less_dcp", 5) == ["ok", "ok"]
    finally:
        if not group.broken:
            group.close()


# ================================================================================ an HF model with NoPE layers
def mistral_large4(impl: str, no_rope_layers=(0, 1)):
    """A tiny MistralLarge4ForConditionalGeneration (text decode only; a 1-layer vision tower that never runs):
    layer 0 NoPE (the attention's rope width is 0), layer 1 roped, DSA top-k crossed during the decode."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "MistralLarge4ForConditionalGeneration"):
        pytest.skip(f"transformers {transformers.__version__} has no mistral_large4")
    from mla_compile import models

    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                num_hidden_layers=len(no_rope_layers), num_attention_heads=4, num_key_value_heads=4,
                max_position_embeddings=512, pad_token_id=0, bos_token_id=0, eos_token_id=None, kv_lora_rank=64,
                qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
                first_k_dense_replace=len(no_rope_layers), index_topk=PROMPT + 1, index_n_heads=64,
                index_head_dim=32, no_rope_layers=list(no_rope_layers))
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=16)
    cfg = transformers.MistralLarge4Config(text_config=text, vision_config=vision, attn_implementation=impl)
    return models.spread_weights(transformers.MistralLarge4ForConditionalGeneration(cfg), 0, torch.float32)


PROMPT, STEPS = 5, 3  # kv_len 6 (= index_topk: the dense graph), 7, 8 (the sparse graph)


@pytest.mark.usefixtures("fresh_dynamo")
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_mistral_large4_nope_layer_decode_matches_eager(impl):
    import hf_models as M
    from mla_compile.integrations.hf import DSAStaticCache
    from mla_compile.passes import mla_attention

    model = mistral_large4(impl)
    attn = model.model.language_model.layers[0].self_attn
    assert attn.qk_rope_head_dim == 0 and model.model.language_model.layers[1].self_attn.qk_rope_head_dim > 0
    L = PROMPT + STEPS + 1
    ids, mask = M.batch(T=PROMPT, L=L)
    ref_t, ref_l = M.greedy(model, model, ids, mask, DSAStaticCache(model.config, L), STEPS)
    compiled = torch.compile(model, backend="mla_dcp")
    t, logits = M.greedy(compiled, model, ids, mask, DSAStaticCache(model.config, L), STEPS, prefill=model)
    assert torch.equal(t, ref_t), f"tokens differ:\n{t}\n{ref_t}"
    assert M.rel_err(logits, ref_l) < 1e-4
    counters = torch._dynamo.utils.counters["mla_compile"]
    layers = len(model.model.language_model.layers)
    assert counters[mla_attention.COUNTER] == 2 * layers  # every layer in the dense and in the sparse graph
    assert counters[mla_attention.SKIP_COUNTER] == 0


if __name__ == "__main__":
    _interpreter_child()
