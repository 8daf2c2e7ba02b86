"""HF DeepseekV32 verification steps of S = 3 query tokens on CUDA under the full backend with CUDA-graph trees:
one teacher-forced run crosses index_topk (the dense graph: multi-token mla.decode; the sparse graph:
dsa.indexer_topk over one row per query token + mla.sparse_decode with indices [B, S, K]); tokens equal eager HF
over HF's StaticCache (fp32). The CPU twin is tests/hf/test_hf_dsa_multi_token.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models as M  # noqa: E402
from mla_compile.integrations.hf import cache_kwargs  # noqa: E402

TOPK = 16
PROMPT = 5
S = 3
STEPS = 8  # kv_len 8 .. 29


@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_hf_v32_verification_steps_cuda(kind, impl):
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from mla_compile.integrations.hf import DSAStaticCache, MLAPagedCache
    from mla_compile.passes import mla_attention

    torch._dynamo.reset()
    counters.clear()
    model = M.deepseek_v32(num_layers=2, index_topk=TOPK, attn_impl=impl).cuda()
    L = PROMPT + S * STEPS + 2
    ids, mask = M.batch(B=2, T=PROMPT + S * STEPS, L=L)
    ids, mask = ids.cuda(), mask.cuda()
    ref_cache = StaticCache(config=model.config, max_cache_len=L)
    cache = (DSAStaticCache(model.config, L) if kind == "static"
             else MLAPagedCache(model.config, L, page_size=8, shuffle_pages=True))
    step = torch.compile(model, backend="mla_dcp", mode="reduce-overhead", fullgraph=True, dynamic=False)
    worst = 0.0
    with torch.no_grad():
        for c in (ref_cache, cache):
            model(ids[:, :PROMPT], attention_mask=mask[:, :PROMPT], **cache_kwargs(model, c))
        for i in range(STEPS):
            new = ids[:, PROMPT + S * i: PROMPT + S * (i + 1)]
            got = step(new, attention_mask=mask, **cache_kwargs(model, cache)).logits.float().clone()
            ref = model(new, attention_mask=mask, **cache_kwargs(model, ref_cache)).logits.float()
            assert torch.equal(got.argmax(-1), ref.argmax(-1)), (i, got.argmax(-1), ref.argmax(-1))
            worst = max(worst, M.rel_err(got, ref))
    torch._dynamo.reset()
    assert worst < 1e-3, worst
    c = counters["mla_compile"]
    assert c[mla_attention.TOKENS_COUNTER] == 4 and c[mla_attention.SPARSE_COUNTER] == 2, dict(c)  # 2 layers x 2
    assert c[mla_attention.SKIP_COUNTER] == 0, dict(c)
