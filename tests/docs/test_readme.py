"""README's Python snippets run as written: each ```python block starts with `# README: <name>`.

Most run in this process (exec); the DCP snippet says "run with torchrun", so it runs under torchrun on 2 CPU
ranks (gloo)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCKS = dict(re.findall(r"```python\n# README: (\S+)\n(.*?)```", TEXT, flags=re.S))
TORCHRUN = {"dcp-torchrun"}


def test_every_python_snippet_is_tested():
    assert TEXT.count("```python\n") == len(BLOCKS), "a ```python block without a `# README: <name>` first line"
    assert {"generate", "eager-generate", "compile-step", "options", "dcp-torchrun", "dsa-step", "mlir",
            "which-kernel", "fp8-cache", "tp-dcp", "continuous-batching"} == set(BLOCKS), sorted(BLOCKS)


def _exec(name: str) -> dict:
    import torch

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    scope: dict = {"__name__": f"readme_{name}"}
    exec(compile(BLOCKS[name], f"README.md:{name}", "exec"), scope)  # noqa: S102 - our own README
    return scope


@pytest.mark.parametrize("name", sorted(set(BLOCKS) - TORCHRUN))
def test_readme_snippet_runs(name, capsys):
    if name in {"generate", "eager-generate", "compile-step", "options", "dsa-step", "mlir", "fp8-cache", "tp-dcp"}:
        pytest.importorskip("transformers")
    if name == "mlir":
        pytest.importorskip("torch_mlir")
    if name == "continuous-batching":
        pytest.importorskip("transformers.generation.continuous_batching.cache_allocators.compressed_latents",
                            reason="HF continuous batching caches MLA latents from transformers 5.25")
    if name == "which-kernel":
        pytest.importorskip("triton")
    scope = _exec(name)
    from torch._dynamo.utils import counters

    out = capsys.readouterr().out
    if name == "eager-generate":
        assert scope["out"].shape == (2, 16)
        assert counters["mla_compile"]["mla_attention_rewritten"] == 2
    if name == "fp8-cache":
        import torch

        from mla_compile import fp8

        assert scope["out"].shape == (2, 16) and fp8.token_bytes(512, 64) == 656
        assert scope["cache"].layers[0].keys.dtype == torch.uint8 and scope["cache"].layers[0].keys.shape[-1] == 656
        scales = fp8.views(scope["cache"].layers[0].keys, 512)[1]
        written = scales[scales != 0]  # unwritten slots stay zero
        assert written.numel() and torch.equal(written, torch.exp2(torch.log2(written).round()))  # ue8m0
        assert counters["mla_compile"]["mla_attention_rewritten"] == 2
        stated = f"{(1 << 30) // 656:,} tokens per GiB against {(1 << 30) // 1152:,}"  # computed, scales counted
        assert stated in TEXT, stated
    if name == "tp-dcp":
        assert counters["mla_compile"]["dsa_index_mask_dropped"] >= 1, dict(counters["mla_compile"])
        assert counters["mla_compile"]["dsa_sparse_rewritten"] >= 1, dict(counters["mla_compile"])
    if name == "generate":
        assert scope["out"].shape == (2, 8 + 12)
        assert counters["mla_compile"]["mla_attention_rewritten"] >= 2
    if name == "continuous-batching":
        assert counters["mla_compile"]["mla_attention_dense_rewritten"] >= 1, dict(counters["mla_compile"])
        assert counters["mla_compile"]["mla_attention_not_rewritten"] == 0, dict(counters["mla_compile"])
        model, prompts, gen = scope["model"], scope["prompts"], scope["gen"]
        ref = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=type(scope["cb"])(
            page_size=16, num_blocks=64, max_batch_tokens=64))  # HF uncompiled: the same tokens
        assert {k: v.generated_tokens for k, v in scope["out"].items()} == {
            k: v.generated_tokens for k, v in ref.items()}
    if name == "compile-step":
        assert len(scope["tokens"]) == 9 and counters["mla_compile"]["mla_attention_rewritten"] == 2
    if name == "options":
        assert "options: unknown key 'fuse_linear'" in out
    if name == "dsa-step":
        c = counters["mla_compile"]
        assert c["mla_attention_rewritten"] == 4 and c["dsa_index_mask_dropped"] == 2 and c["dsa_sparse_rewritten"] == 2
    if name == "mlir":
        assert 'torch.operator "torch.mla.decode"' in scope["text"]
    if name == "which-kernel":
        lines = out.splitlines()
        assert "name='seesaw'" in lines[0], lines
        few = "swapab" if importlib.util.find_spec("triton.experimental.gluon") else "triton"
        from mla_compile import tuning
        from mla_compile.kernels import decode_swapab

        # swapab's TOKENS form: auto's when switched on
        tokens = few if tuning.swapab_tokens(decode_swapab.TOKENS_IN_AUTO) else "triton"
        assert lines[1:] == ["flashmla", "seesaw", few, "triton", tokens,
                             "fp8_swapab" if few == "swapab" else "triton", "triton"], lines


def test_readme_dcp_snippet_runs_under_torchrun(tmp_path):
    script = tmp_path / "dcp_demo.py"
    script.write_text(BLOCKS["dcp-torchrun"])
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    # PYTHONFAULTHANDLER: a rank that aborts prints its Python stacks (on the agent's stderr, shown on failure)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1", PYTHONPATH=os.pathsep.join(path))
    logs = tmp_path / "logs"  # each rank's stdout in a file of its own: on one pipe, two prints can interleave
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(logs), "--redirects", "1", str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    outs = {f.parent.name: f.read_text() for f in logs.rglob("stdout.log")}
    assert sorted(outs) == ["0", "1"], (outs, proc.stderr[-3000:])
    lines = [next(ln for ln in outs[r].splitlines() if ln.startswith(f"{r} ")) for r in ("0", "1")]
    # both ranks return the merged [B, H, R] result; rank r holds the tokens t % 2 == r of each request
    assert all("torch.Size([4, 16, 512])" in ln for ln in lines), lines
    assert lines[0].endswith("[504, 554, 604, 654]") and lines[1].endswith("[504, 554, 604, 654]"), lines
