"""Rope-less MLA (P = 0) on CUDA: `mla.decode` / `mla.sparse_decode` through the Triton route (a zero rope column of
width 1) vs the float64 reference, inside a CUDA graph too, and a tiny HF mistral_large4 with a NoPE layer
compiled with `mla_dcp` under "reduce-overhead" vs eager HF (tests/ops/test_rope_less.py checks the same on CPU)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import reference as ref  # noqa: E402
from gpu_util import capture, rel  # noqa: E402

import mla_compile  # noqa: E402,F401


def _problem(dtype, H, lens, PS=64, R=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    _, (c, k), bt, sl, _ = ref.build_paged(lens, PS, (R, 0), torch.float32, generator=g, extra_cols=1)
    q = torch.randn(len(lens), H, R, generator=g)
    dev = dict(device="cuda")
    return (q.to(dtype).to(**dev), torch.zeros(len(lens), H, 0, dtype=dtype, **dev), c.to(dtype).to(**dev),
            k.to(dtype).to(**dev), bt.to(**dev), sl.to(**dev))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("H", [16, 128])
def test_rope_less_decode_cuda_matches_float64(dtype, H):
    lens = [700, 0, 129, 64]
    q, qp, c, k, bt, sl = _problem(dtype, H, lens)
    scale = 1 / math.sqrt(512)
    out, lse = torch.ops.mla.decode(q, qp, c, k, bt, sl, scale)
    r_out, r_lse = ref.ref_decode(q.double().cpu(), qp.double().cpu(), c.double().cpu(), k.double().cpu(),
                                  bt.cpu(), sl.cpu(), scale)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    assert rel(out, r_out) < tol
    assert torch.equal(lse[1].cpu(), torch.full_like(lse[1].cpu(), float("-inf")))  # the empty request
    assert torch.equal(out[1].cpu(), torch.zeros_like(out[1].cpu()))
    keep = sl.cpu() > 0
    assert (lse.cpu()[keep].double() - r_lse[keep]).abs().max() < (5e-3 if dtype == torch.bfloat16 else 1e-4)
    graph, (g_out, g_lse) = capture(lambda: torch.ops.mla.decode(q, qp, c, k, bt, sl, scale))
    graph.replay()
    assert torch.equal(g_out, out) and torch.equal(g_lse, lse)


def test_rope_less_sparse_decode_cuda_matches_float64():
    lens = [300, 77]
    q, qp, c, k, bt, sl = _problem(torch.bfloat16, 16, lens)
    rows = [ref.request_slots(bt.cpu(), 64, b, n)[::3] for b, n in enumerate(lens)]
    K = max(map(len, rows))
    idx = torch.tensor([r + [-1] * (K - len(r)) for r in rows], dtype=torch.int32, device="cuda")
    scale = 1 / math.sqrt(512)
    out, lse = torch.ops.mla.sparse_decode(q, qp, c, k, idx, scale)
    r_out, _ = ref.ref_sparse_decode(q.double().cpu(), qp.double().cpu(), c.double().cpu(), k.double().cpu(),
                                     idx.cpu(), scale)
    assert rel(out, r_out) < 2e-2


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_nope_layer_reduce_overhead_matches_eager(impl):
    """mistral_large4 with a NoPE layer (P = 0) and a roped one, DSA top-k crossed: mla_dcp under
    "reduce-overhead" on CUDA, fp32 tokens equal eager HF's."""
    import hf_models as M
    from test_rope_less import PROMPT, STEPS, mistral_large4

    from mla_compile.integrations.hf import DSAStaticCache
    from mla_compile.passes import mla_attention

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = mistral_large4(impl).cuda()
    L = PROMPT + STEPS + 1
    ids, mask = M.batch(T=PROMPT, L=L)
    ids, mask = ids.cuda(), mask.cuda()
    ref_t, ref_l = M.greedy(model, model, ids, mask, DSAStaticCache(model.config, L), STEPS)
    compiled = torch.compile(model, backend="mla_dcp", mode="reduce-overhead")
    t, logits = M.greedy(compiled, model, ids, mask, DSAStaticCache(model.config, L), STEPS, prefill=model)
    assert torch.equal(t, ref_t), f"tokens differ:\n{t}\n{ref_t}"
    assert M.rel_err(logits, ref_l) < 1e-3
    assert torch._dynamo.utils.counters["mla_compile"][mla_attention.COUNTER] == 2 * 2
