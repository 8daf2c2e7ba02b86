"""MLIR export (issue 8): torch-mlir's FX importer on the rewritten decode step, custom ops and the in-place
cache write preserved. Snapshots: `EXPECTTEST_ACCEPT=1 python -m pytest tests/passes/test_mlir.py` rewrites them."""

from __future__ import annotations

import re
import sys

import expecttest
import pytest
import torch

from mla_compile import mlir

needs_torch_mlir = pytest.mark.skipif(
    not mlir.is_available(), reason=f"torch-mlir not importable; install it with: {mlir.INSTALL_HINT}")


def _pass_available() -> bool:
    try:
        from mla_compile.passes import mla_attention  # noqa: F401
    except ImportError:
        return False
    return True


def cache_write_results(text: str, cache_args: tuple[str, str]) -> str:
    """Assert the in-place write is in the MLIR AND threaded: the mutable cache arguments are read into value
    tensors, `torch.mla.cache_write` returns the written caches, those overwrite the arguments, and the
    caches' later readers use the written values. Returns the write's SSA result name."""
    ckv_arg, kpe_arg = cache_args
    for arg in cache_args:
        assert re.search(rf"{arg}: !torch\.tensor<", text), f"{arg} should be a mutable !torch.tensor argument"
    reads = {m.group(2): m.group(1) for m in re.finditer(r"(%\w+) = torch\.copy\.to_vtensor (%arg\d+)", text)}
    m = re.search(r'^\s*(%\w+):2 = torch\.operator "torch\.mla\.cache_write"\((%\w+), (%\w+),', text, re.M)
    assert m, "no value-returning torch.mla.cache_write in:\n" + text
    res = m.group(1)
    assert (m.group(2), m.group(3)) == (reads[ckv_arg], reads[kpe_arg]), "cache_write must read the cache args"
    assert f"torch.overwrite.tensor.contents {res}#0 overwrites {ckv_arg} " in text
    assert f"torch.overwrite.tensor.contents {res}#1 overwrites {kpe_arg} " in text
    return res


def depends_on(text: str, value: str, source: str) -> bool:
    """Whether SSA `value` is computed (transitively) from SSA `source` in the MLIR text."""
    deps: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.match(r"\s*(%[\w.-]+)(?::\d+)? = (.*)$", line)
        if m:
            deps[m.group(1)] = [v.split("#")[0] for v in re.findall(r"%[\w.-]+(?:#\d+)?", m.group(2))]
    seen, todo = set(), [value.split("#")[0]]
    while todo:
        v = todo.pop()
        if v == source.split("#")[0]:
            return True
        if v not in seen:
            seen.add(v)
            todo.extend(deps.get(v, []))
    return False


@needs_torch_mlir
class TestOpStep(expecttest.TestCase):
    def test_snapshot(self):
        fn, args = mlir.example_op_step()
        text = mlir.normalize_mlir(mlir.export_mlir(fn, args))
        self.assertExpectedInline(text, """\
// mla_compile.export_mlir: @main arguments
//   %arg0 = q_nope
//   %arg1 = q_pe
//   %arg2 = ckv
//   %arg3 = kpe
//   %arg4 = ckv_cache  (mutated in place)
//   %arg5 = kpe_cache  (mutated in place)
//   %arg6 = block_table
//   %arg7 = seq_lens
//   %arg8 = slots
module {
  func.func @main(%arg0: !torch.vtensor<[2,4,8],f32>, %arg1: !torch.vtensor<[2,4,4],f32>, %arg2: !torch.vtensor<[2,8],f32>, %arg3: !torch.vtensor<[2,4],f32>, %arg4: !torch.tensor<[4,4,8],f32>, %arg5: !torch.tensor<[4,4,4],f32>, %arg6: !torch.vtensor<[2,2],si32>, %arg7: !torch.vtensor<[2],si32>, %arg8: !torch.vtensor<[2],si64>) -> (!torch.vtensor<[2,4,8],f32>, !torch.vtensor<[2,4],f32>) attributes {torch.assume_strict_symbolic_shapes} {
    %0 = torch.copy.to_vtensor %arg4 : !torch.vtensor<[4,4,8],f32>
    %1 = torch.copy.to_vtensor %arg5 : !torch.vtensor<[4,4,4],f32>
    %2:2 = torch.operator "torch.mla.cache_write"(%0, %1, %arg2, %arg3, %arg8) : (!torch.vtensor<[4,4,8],f32>, !torch.vtensor<[4,4,4],f32>, !torch.vtensor<[2,8],f32>, !torch.vtensor<[2,4],f32>, !torch.vtensor<[2],si64>) -> (!torch.vtensor<[4,4,8],f32>, !torch.vtensor<[4,4,4],f32>)
    torch.overwrite.tensor.contents %2#0 overwrites %arg4 : !torch.vtensor<[4,4,8],f32>, !torch.tensor<[4,4,8],f32>
    torch.overwrite.tensor.contents %2#1 overwrites %arg5 : !torch.vtensor<[4,4,4],f32>, !torch.tensor<[4,4,4],f32>
    %float2.500000e-01 = torch.constant.float 2.500000e-01
    %none = torch.constant.none
    %3:2 = torch.operator "torch.mla.decode"(%arg0, %arg1, %2#0, %2#1, %arg6, %arg7, %float2.500000e-01, %none) : (!torch.vtensor<[2,4,8],f32>, !torch.vtensor<[2,4,4],f32>, !torch.vtensor<[4,4,8],f32>, !torch.vtensor<[4,4,4],f32>, !torch.vtensor<[2,2],si32>, !torch.vtensor<[2],si32>, !torch.float, !torch.none) -> (!torch.vtensor<[2,4,8],f32>, !torch.vtensor<[2,4],f32>)
    return %3#0, %3#1 : !torch.vtensor<[2,4,8],f32>, !torch.vtensor<[2,4],f32>
  }
}
""")
        res = cache_write_results(text, ("%arg4", "%arg5"))
        # decode reads the WRITTEN cache (the new token is attended), not the stale argument
        assert re.search(rf'torch\.operator "torch\.mla\.decode"\(%arg0, %arg1, {res}#0, {res}#1,', text)

    def test_export_does_not_run_the_step(self):
        fn, args = mlir.example_op_step()
        before = [a.clone() for a in args]
        mlir.export_mlir(fn, args)
        assert all(torch.equal(a, b) for a, b in zip(args, before)), "export must not write the caches"

    def test_repeated_exports_never_hit_the_recompile_limit(self):
        fn, args = mlir.example_op_step()
        limit = torch._dynamo.config.recompile_limit
        for _ in range(limit + 1):
            text = mlir.export_program(fn, args, decompose=False)[0]
        assert "mla.cache_write" in str(text.graph)

    def test_empty_decomposition_table_would_drop_the_write(self):
        """Why export_mlir always functionalizes: torch-mlir's export_and_import with decomposition_table=[]
        imports the in-place op as a result-less op on value tensors, and the write is gone."""
        from torch_mlir import fx as tm_fx

        fn, args = mlir.example_op_step()

        class Step(torch.nn.Module):
            def forward(self, *a):
                return fn(*a)

        with torch._export.config.patch(enable_auto_functionalized_v2_for_export=False):
            ep = torch.export.export(Step(), args, strict=False)
            dropped = str(tm_fx.export_and_import(ep, experimental_support_mutation=True, decomposition_table=[]))
        assert 'torch.operator "torch.mla.cache_write"' in dropped
        assert "overwrites" not in dropped  # silently lost: the trap the tests above guard against

    def test_module_weights_as_arguments_or_constants(self):
        class Step(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(8, 8, bias=False)

            def forward(self, x, ckv_cache, kpe_cache, kpe, slots):
                torch.ops.mla.cache_write(ckv_cache, kpe_cache, self.proj(x), kpe, slots)
                return ckv_cache.sum()

        args = (torch.randn(2, 8), torch.zeros(2, 4, 8), torch.zeros(2, 4, 4), torch.randn(2, 4),
                torch.tensor([1, 6]))
        text = mlir.normalize_mlir(mlir.export_mlir(Step(), args))
        assert "//   %arg5 = proj.weight\n" in text
        cache_write_results(text, ("%arg1", "%arg2"))
        text = mlir.normalize_mlir(mlir.export_mlir(Step(), args, weights="constants"))
        assert "proj.weight" not in text and "dense_resource" in text and "<elided>" in text
        cache_write_results(text, ("%arg1", "%arg2"))

    def test_cli(self):
        import contextlib
        import io

        from mla_compile.__main__ import main

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            assert main(["export-mlir"]) == 0
        assert 'torch.operator "torch.mla.decode"' in buf.getvalue()


def test_missing_torch_mlir_says_what_to_install(monkeypatch):
    for name in [m for m in sys.modules if m == "torch_mlir" or m.startswith("torch_mlir.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "torch_mlir", None)  # import torch_mlir -> ImportError
    assert not mlir.is_available()
    with pytest.raises(ImportError, match=r"pip install 'mla-compile\[mlir\]'"):
        mlir.export_mlir(lambda x: x + 1, (torch.ones(2),))


# ------------------------------------------------------------------------------------- HF DeepseekV3
@needs_torch_mlir
class TestHFDecodeStep(expecttest.TestCase):
    """One-layer HF DeepseekV3 decode step with HF's StaticCache (tiny config, random weights)."""

    def test_without_rewrite_cache_update_is_kept(self):
        model, args, kwargs = mlir.example_hf_step()
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        keys_before = cache.layers[0].keys.clone()
        text = mlir.export_mlir(model, args, kwargs, rewrite=False)
        assert torch.equal(cache.layers[0].keys, keys_before), "export must not advance the cache"
        assert "torch.mla" not in text
        header = text.split("module {")[0]
        assert "%arg2 = cache_layers_0_keys  (mutated in place)" in header
        assert "%arg10 = model.layers.0.self_attn.kv_b_proj.weight" in header
        # HF's in-place StaticCache update survives as overwrites of the cache arguments
        assert "overwrites %arg2 :" in text and "overwrites %arg3 :" in text

    @pytest.mark.skipif(not _pass_available(), reason="the HF attention pass (passes/mla_attention.py) is not in this tree")
    def test_rewritten_snapshot(self):
        from mla_compile.passes.mla_attention import COUNTER

        torch._dynamo.utils.counters.clear()
        model, args, kwargs = mlir.example_hf_step()
        text = mlir.export_mlir(model, args, kwargs)
        assert torch._dynamo.utils.counters["mla_compile"][COUNTER] == 1
        assert text.count('torch.operator "torch.mla.decode"') == 1
        assert "overwrites %arg2 :" in text and "overwrites %arg3 :" in text
        # mla.decode reads the latent cache AFTER this step's write (the new token is attended)
        written = {m.group(2): m.group(1) for m in
                   re.finditer(r"torch\.overwrite\.tensor\.contents (%[\w#]+) overwrites (%arg\d+)", text)}
        dec = re.search(r'torch\.operator "torch\.mla\.decode"\((%[\w#.-]+), (%[\w#.-]+), (%[\w#.-]+), (%[\w#.-]+),', text)
        assert depends_on(text, dec.group(3), written["%arg2"]), "decode must read the written latent cache"
        assert depends_on(text, dec.group(4), written["%arg3"]), "decode must read the written rope cache"
        assert depends_on(text, dec.group(1), "%arg10"), "q_nope is absorbed through kv_b_proj (W_UK)"
        self.assertExpectedInline(mlir.summarize_mlir(text), """\
// mla_compile.export_mlir: @main arguments
//   %arg0 = input_ids
//   %arg1 = cache_layers_0_cumulative_length  (mutated in place)
//   %arg2 = cache_layers_0_keys  (mutated in place)
//   %arg3 = cache_layers_0_values  (mutated in place)
//   %arg4 = model.embed_tokens.weight
//   %arg5 = model.rotary_emb.inv_freq
//   %arg6 = model.layers.0.input_layernorm.weight
//   %arg7 = model.layers.0.self_attn.q_proj.weight
//   %arg8 = model.layers.0.self_attn.kv_a_proj_with_mqa.weight
//   %arg9 = model.layers.0.self_attn.kv_a_layernorm.weight
//   %arg10 = model.layers.0.self_attn.kv_b_proj.weight
//   %arg11 = model.layers.0.self_attn.o_proj.weight
//   %arg12 = model.layers.0.post_attention_layernorm.weight
//   %arg13 = model.layers.0.mlp.gate_proj.weight
//   %arg14 = model.layers.0.mlp.up_proj.weight
//   %arg15 = model.layers.0.mlp.down_proj.weight
//   %arg16 = model.norm.weight
//   %arg17 = lm_head.weight
  func.func @main(%arg0: !torch.vtensor<[2,1],si64>, %arg1: !torch.tensor<[],si64>, %arg2: !torch.tensor<[2,1,8,16],f32>, %arg3: !torch.tensor<[2,1,8,8],f32>, %arg4: !torch.vtensor<[64,32],f32>, %arg5: !torch.vtensor<[4],f32>, %arg6: !torch.vtensor<[32],f32>, %arg7: !torch.vtensor<[32,32],f32>, %arg8: !torch.vtensor<[24,32],f32>, %arg9: !torch.vtensor<[16],f32>, %arg10: !torch.vtensor<[32,16],f32>, %arg11: !torch.vtensor<[32,16],f32>, %arg12: !torch.vtensor<[32],f32>, %arg13: !torch.vtensor<[64,32],f32>, %arg14: !torch.vtensor<[64,32],f32>, %arg15: !torch.vtensor<[32,64],f32>, %arg16: !torch.vtensor<[32],f32>, %arg17: !torch.vtensor<[64,32],f32>) -> !torch.vtensor<[2,1,64],f32> attributes {torch.assume_strict_symbolic_shapes} {
    %0 = torch.copy.to_vtensor %arg1 : !torch.vtensor<[],si64>
    %1 = torch.copy.to_vtensor %arg2 : !torch.vtensor<[2,1,8,16],f32>
    %2 = torch.copy.to_vtensor %arg3 : !torch.vtensor<[2,1,8,8],f32>
    torch.overwrite.tensor.contents %3 overwrites %arg1 : !torch.vtensor<[],si64>, !torch.tensor<[],si64>
    torch.overwrite.tensor.contents %4 overwrites %arg2 : !torch.vtensor<[2,1,8,16],f32>, !torch.tensor<[2,1,8,16],f32>
    torch.overwrite.tensor.contents %5 overwrites %arg3 : !torch.vtensor<[2,1,8,8],f32>, !torch.tensor<[2,1,8,8],f32>
    %6:2 = torch.operator "torch.mla.decode"(%7, %8, %9, %10, %11, %12, %13, %14) : (!torch.vtensor<[2,2,16],f32>, !torch.vtensor<[2,2,8],f32>, !torch.vtensor<[16,1,16],f32>, !torch.vtensor<[16,1,8],f32>, !torch.vtensor<[2,8],si32>, !torch.vtensor<[2],si32>, !torch.float, !torch.none) -> (!torch.vtensor<[2,2,16],f32>, !torch.vtensor<[2,2],f32>)
    return %15 : !torch.vtensor<[2,1,64],f32>
""")
