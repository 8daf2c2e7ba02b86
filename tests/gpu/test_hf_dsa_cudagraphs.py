"""HF DeepseekV32 decode, DSA dense / sparse graphs under CUDA-graph trees (mode="reduce-overhead").

`DSAStaticCache` keeps the host int `max_kv_len`; Dynamo guards on it against `index_topk`, giving exactly
two graphs. Each must be recorded once (the int is not a graph input: the backend computes the cache's
`max_kv_len += 1` outside the compiled graph), with no cudagraph skips and no re-recording over 200+ steps.
Works whether or not the attention itself is rewritten (transformers 5.17 caches expanded K/V for V3.2, so
only the dense graph's index mask drop applies there).
"""

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

TOPK = 32
PROMPT = 5
STEPS = 230


@pytest.mark.parametrize("batch", [2, 4])
def test_hf_v32_each_variant_recorded_once(batch, cudagraph_recordings):
    from torch._dynamo.utils import counters
    from transformers import StaticCache

    from mla_compile.integrations.hf import DSAStaticCache

    recordings = cudagraph_recordings

    model = M.deepseek_v32(num_layers=2, index_topk=TOPK, attn_impl="sdpa").cuda()
    L = PROMPT + STEPS + 1
    ids, mask = M.batch(B=batch, T=PROMPT, L=L)
    ids, mask = ids.cuda(), mask.cuda()
    ref_cache, cache = StaticCache(config=model.config, max_cache_len=L), DSAStaticCache(model.config, L)
    step = torch.compile(model, backend="mla_dcp", mode="reduce-overhead", fullgraph=True)
    crossed, worst = False, 0.0
    try:
        with torch.no_grad():
            for c in (ref_cache, cache):
                out = model(ids, attention_mask=mask[:, :PROMPT], **cache_kwargs(model, c),
                            cache_position=torch.arange(PROMPT, device="cuda"))
            tok = out.logits[:, -1].argmax(-1)
            for i in range(STEPS):
                if i == 40:  # both variants compiled and recorded (max_kv_len passes TOPK at step ~27)
                    torch.compiler.set_stance("fail_on_recompile")
                crossed |= cache.max_kv_len > TOPK
                pos = torch.tensor([PROMPT + i], device="cuda")
                ref = model(tok[:, None], attention_mask=mask, **cache_kwargs(model, ref_cache), cache_position=pos)
                got = step(tok[:, None], attention_mask=mask, **cache_kwargs(model, cache), cache_position=pos)
                worst = max(worst, M.rel_err(got.logits[:, -1], ref.logits[:, -1]))
                tok = ref.logits[:, -1].argmax(-1)  # teacher-forced: both paths see the same tokens
    finally:
        torch.compiler.set_stance("default")
    assert crossed
    assert worst < 2e-3, worst
    assert counters["stats"]["unique_graphs"] == 2
    assert counters["mla_compile"]["dsa_index_mask_dropped"] == 2  # both layers of the dense graph
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(recordings) == 2, f"expected one recording per variant, got {len(recordings)}"
    assert len(set(recordings)) == 2
