"""README's Python snippets run as written: each ```python block whose first line is `# README: <name>`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = dict(re.findall(r"```python\n# README: (\S+)\n(.*?)```", README.read_text(), flags=re.S))


def test_readme_has_tested_snippets():
    assert {"generate", "eager-generate"} <= set(BLOCKS), sorted(BLOCKS)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_readme_snippet_runs(name):
    pytest.importorskip("transformers")
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    scope: dict = {}
    exec(compile(BLOCKS[name], f"README.md:{name}", "exec"), scope)  # noqa: S102 - our own README
    if name == "eager-generate":
        assert scope["out"].shape == (2, 16)
        assert torch._dynamo.utils.counters["mla_compile"]["mla_attention_rewritten"] == 2
    if name == "fp8-cache":
        from mla_compile import fp8

        assert scope["out"].shape == (2, 16) and fp8.token_bytes(512, 64) == 656
        assert scope["cache"].layers[0].keys.dtype == torch.uint8 and scope["cache"].layers[0].keys.shape[-1] == 656
        assert torch._dynamo.utils.counters["mla_compile"]["mla_attention_rewritten"] == 2
        stated = f"{(1 << 30) // 656:,} tokens per GiB against {(1 << 30) // 1152:,}"  # computed, scales counted
        assert stated in README.read_text(), stated
    if name == "tp-dcp":
        counters = torch._dynamo.utils.counters["mla_compile"]
        assert counters["dsa_index_mask_dropped"] >= 1 and counters["dsa_sparse_rewritten"] >= 1, dict(counters)
    if name == "generate":
        assert scope["out"].shape == (2, 8 + 12)
        assert torch._dynamo.utils.counters["mla_compile"]["mla_attention_rewritten"] >= 2
