"""HF speculative verification on CUDA under CUDA-graph trees (HF's auto-compile, mode "reduce-overhead"):
`generate(assistant_model=...)` and `generate(prompt_lookup_num_tokens=...)` with the mask built in the graph.
The verification steps (2-4 query tokens) are CUDA-graphed decode steps (passes/step_kind.py) rewritten into
mla.decode with per-query-token limits (passes/attention_tokens.py); HF crops the cache after rejected drafts.
fp32: tokens identical to eager generate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import hf_models as M  # noqa: E402

from mla_compile.integrations.hf import (MLAPagedCache, cache_kwargs, compile_config,  # noqa: E402
                                         create_masks_in_graph)
from mla_compile.passes import mla_attention  # noqa: E402

COUNTERS = torch._dynamo.utils.counters
NEW = 24




def _generate(model, ids, compiled, cache, **kw):
    extra = dict(compile_config=compile_config()) if compiled else dict(disable_compile=True)
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW,
                              do_sample=False, pad_token_id=0, cache_implementation=None,
                              **cache_kwargs(model, cache), **extra, **kw)


def _prompt():
    base = torch.randint(1, 120, (1, 5), generator=torch.Generator().manual_seed(5))
    return base.repeat(1, 4).cuda()


@pytest.mark.parametrize("cache_kind", ["static", "paged"])
@pytest.mark.parametrize("road", ["assistant", "prompt_lookup"])
def test_verification_reduce_overhead_fp32_tokens_equal_eager(road, cache_kind):
    from transformers import StaticCache

    model = M.deepseek_v3(num_layers=2, heads=16, hidden=256).cuda()
    model.create_masks_for_generate = create_masks_in_graph
    ids = _prompt()
    L = ids.shape[1] + NEW + 8
    make = (lambda: StaticCache(config=model.config, max_cache_len=L)) if cache_kind == "static" else \
        (lambda: MLAPagedCache(model.config, max_cache_len=L, page_size=16, shuffle_pages=True))
    if road == "assistant":
        draft = M.deepseek_v3(num_layers=1, heads=16, hidden=256, seed=7).cuda()
        draft.generation_config.num_assistant_tokens = 3
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        kw = dict(assistant_model=draft)
    else:
        kw = dict(prompt_lookup_num_tokens=3)
    ref = _generate(model, ids, False, make(), **kw)
    M.fresh(model)
    for _ in range(2):  # the second generate replays the recorded graphs (a new cache each call)
        out = _generate(model, ids, True, make(), **kw)
        assert torch.equal(out, ref), (out, ref)
    c = COUNTERS["mla_compile"]
    assert c[mla_attention.TOKENS_COUNTER] >= 2 and c[mla_attention.SKIP_COUNTER] == 0, dict(c)
