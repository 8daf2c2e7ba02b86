"""MLIR export (issue 8): torch-mlir's FX importer on the rewritten decode step, custom ops and the in-place
cache write preserved. Snapshots: `EXPECTTEST_ACCEPT=1 python -m pytest tests/test_mlir.py` rewrites them."""

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
    %3:2 = torch.operator "torch.mla.decode"(%arg0, %arg1, %2#0, %2#1, %arg6, %arg7, %float2.500000e-01) : (!torch.vtensor<[2,4,8],f32>, !torch.vtensor<[2,4,4],f32>, !torch.vtensor<[4,4,8],f32>, !torch.vtensor<[4,4,4],f32>, !torch.vtensor<[2,2],si32>, !torch.vtensor<[2],si32>, !torch.float) -> (!torch.vtensor<[2,4,8],f32>, !torch.vtensor<[2,4],f32>)
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
        cache = kwargs["past_key_values"]
        keys_before = cache.layers[0].keys.clone()
        text = mlir.export_mlir(model, args, kwargs, rewrite=False)
        assert torch.equal(cache.layers[0].keys, keys_before), "export must not advance the cache"
        assert "torch.mla" not in text
        header = text.split("module {")[0]
        assert "%arg2 = past_key_values_layers_0_keys  (mutated in place)" in header
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
