"""The HF-integration ops (`mla_hf::gather_latent`, `mla_hf::all_selected`): opcheck, semantics, validation."""

import pytest
import torch

import mla_compile.integrations.hf  # noqa: F401  (registers mla_hf ops)
from mla_compile.paged import fill_paged

pytest.importorskip("transformers")


def _paged(lens, PS, seed=0):
    g = torch.Generator().manual_seed(seed)
    ckv = [torch.randn(n, 8, generator=g) for n in lens]
    kpe = [torch.randn(n, 4, generator=g) for n in lens]
    return ckv, kpe, fill_paged(ckv, kpe, PS, shuffle=True, generator=g)


@pytest.mark.parametrize("PS", [1, 4])
def test_gather_latent_is_the_token_ordered_latent(PS):
    lens = [7, 0, 12]
    ckv, kpe, b = _paged(lens, PS)
    b.ckv_cache.nan_to_num_(0.0)
    b.kpe_cache.nan_to_num_(0.0)
    max_len = 12
    out_c, out_k = torch.ops.mla_hf.gather_latent(b.ckv_cache, b.kpe_cache, b.block_table, max_len, 1, 0, "")
    assert out_c.shape == (3, 1, max_len, 8) and out_k.shape == (3, 1, max_len, 4)
    for r, n in enumerate(lens):
        torch.testing.assert_close(out_c[r, 0, :n], ckv[r], rtol=0, atol=0)
        torch.testing.assert_close(out_k[r, 0, :n], kpe[r], rtol=0, atol=0)
    torch.library.opcheck(torch.ops.mla_hf.gather_latent.default,
                          (b.ckv_cache, b.kpe_cache, b.block_table, max_len, 1, 0, ""))


def test_all_selected_is_a_copy():
    keys = torch.randn(2, 5, 16)
    out = torch.ops.mla_hf.all_selected(keys, 8)
    assert torch.equal(out, keys) and out.data_ptr() != keys.data_ptr()
    torch.library.opcheck(torch.ops.mla_hf.all_selected.default, (keys, 8))


@pytest.mark.parametrize("args, name", [
    (dict(max_len=10_000), "max_len"), (dict(dcp_size=0), "dcp_size"), (dict(dcp_rank=2, dcp_size=2), "dcp_rank"),
    (dict(block_table=torch.zeros(3, 4, dtype=torch.int64)), "block_table"),
    (dict(kpe_cache=torch.zeros(1, 1, 4)), "kpe_cache"),
])
def test_gather_latent_bad_inputs_name_the_argument(args, name):
    _, _, b = _paged([3, 5], 4)
    kw = dict(ckv_cache=b.ckv_cache, kpe_cache=b.kpe_cache, block_table=b.block_table, max_len=5, dcp_size=1,
              dcp_rank=0, group_name="")
    kw.update(args)
    with pytest.raises(ValueError, match=f"^{name}: "):
        torch.ops.mla_hf.gather_latent(**kw)


def test_all_selected_rejects_bad_topk():
    with pytest.raises(ValueError, match="^topk: "):
        torch.ops.mla_hf.all_selected(torch.zeros(1, 2, 3), 0)


def test_gather_latent_opchecks_with_scale_and_heads_sharded():
    """The schema's trailing `Tensor? ckv_scale=None, bool heads_sharded=False`: opcheck with both given (an FP8
    cache, the TP x DCP note), positionally and by keyword; heads_sharded changes nothing in the result (a note for
    the pass)."""
    from mla_compile import fp8

    g = torch.Generator().manual_seed(5)
    lens = [6, 6]  # every gathered slot written (unused ones hold NaN, which opcheck's comparisons refuse)
    ckv = [torch.randn(n, 128, generator=g) for n in lens]
    kpe = [torch.randn(n, 8, generator=g) for n in lens]
    b = fill_paged(ckv, kpe, 4, shuffle=True, generator=g, kv_cache_dtype="fp8_e4m3")
    assert b.ckv_cache.dtype == fp8.DTYPE and b.ckv_scale is not None
    args = (b.ckv_cache, b.kpe_cache, b.block_table, 6, 1, 0, "", b.ckv_scale, True)
    # (the schema-check utils cannot run e4m3 arithmetic on CPU: as test_hf_fp8_cache's opcheck of this op)
    torch.library.opcheck(torch.ops.mla_hf.gather_latent.default, args,
                          test_utils=("test_faketensor", "test_aot_dispatch_dynamic"))
    _, _, p = _paged(lens, 4)
    torch.library.opcheck(torch.ops.mla_hf.gather_latent.default,
                          (p.ckv_cache, p.kpe_cache, p.block_table, 6, 1, 0, "", None, True))
    pos = torch.ops.mla_hf.gather_latent(*args)
    kw = torch.ops.mla_hf.gather_latent(*args[:7], ckv_scale=b.ckv_scale, heads_sharded=True)
    plain = torch.ops.mla_hf.gather_latent(*args[:8])
    for x, y, z in zip(pos, kw, plain):
        assert torch.equal(x, y) and torch.equal(x, z)
    want = fp8.dequantize(*fp8.quantize(ckv[1]), torch.float32)
    assert torch.equal(pos[0][1, 0, :6], want)
