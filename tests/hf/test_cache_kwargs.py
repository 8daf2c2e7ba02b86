"""`cache_kwargs` inside a compiled serving step: one graph, no break, no Dynamo warning about our code.

README's compile recipe writes `model(ids, **cache_kwargs(model, cache), ...)` inside the function users compile, so
Dynamo traces the helper. Its per-class memo was an `functools.lru_cache`, which Dynamo traces through while warning
that this may be silently incorrect: a warning every user of the recipe saw.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mla_compile.integrations import hf as H
import hf_models as M

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("memo", ["empty", "filled"])
def test_compiled_step_with_cache_kwargs_is_one_graph_without_warnings(memo):
    model = M.deepseek_v3(num_layers=1).eval()
    if memo == "empty":
        H._CACHE_ARG_NAMES.clear()  # the first call of the helper is the traced one
    else:
        H.cache_kwargs(model, None)
    ids = torch.randint(0, 128, (1, 4), generator=torch.Generator().manual_seed(0))

    def step(cache):
        return model(ids, **H.cache_kwargs(model, cache), use_cache=True).logits

    want = step(transformers.StaticCache(config=model.config, max_cache_len=16))
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        explained = torch._dynamo.explain(step)(transformers.StaticCache(config=model.config, max_cache_len=16))
        got = torch.compile(step, backend="mla_dcp")(transformers.StaticCache(config=model.config, max_cache_len=16))
    ours = [str(w.message) for w in seen if "lru_cache" in str(w.message) or "integrations/hf.py" in str(w.filename)
            or "hf.py:" in str(w.message)]
    assert ours == []
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    assert H._CACHE_ARG_NAMES[type(model)] in ("cache", "past_key_values")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
