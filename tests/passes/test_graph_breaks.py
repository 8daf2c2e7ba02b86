"""MLA sites split by a graph break. An eager float mask that crosses one (`mla_compile.passes.mask_origin`): rewritten
when the graph that built it proved it a hard mask, checked every call; any other mask is applied as it is (the
attention absorbed with it, `passes/attention_dense.py`). A break between
HF's kv expansion and the attention (glm5_next's kpool indexer): counted not rewritten, and rewritten once Dynamo
traces the data-dependent shape into the graph. Reference: the same function eager in float64 (the rewrite is exact
algebra)."""

from __future__ import annotations

import pytest
import torch

import hf_models as M
from mla_compile.passes import mask_origin
from mla_compile.passes import mla_attention

pytestmark = pytest.mark.usefixtures("fresh_dynamo")

C = torch._dynamo.utils.counters
MIN = torch.finfo(torch.float32).min
WRITE = []  # what the eager region between the graphs writes into the mask (nothing when empty)


@torch._dynamo.disable
def _between(mask):
    """Eager code between two graphs (Dynamo does not trace it, so it adds no guard): writes WRITE's value."""
    if WRITE:
        mask[..., -1] = WRITE[0]
    return mask


def model(q, latent, kpe, w, valid):
    # HF's eager mask, spelled as masking_utils does (constant zero as full((), 0.0))
    mask = torch.where(valid, torch.full((), 0.0, dtype=q.dtype), MIN)
    mask = _between(mask)  # the graph break: the mask is an input of the attention graph
    return M.mla_attention_site(q, latent, kpe, w, mask, impl="eager")


def outside_mask(q, latent, kpe, w, mask):
    return M.mla_attention_site(q, latent, kpe, w, mask, impl="eager")


def _reference(q, latent, kpe, w, mask):
    return M.mla_attention_site(q.double(), latent.double(), kpe.double(), w.double(), mask.double(), impl="eager")


def _err(a, b):
    return ((a.double() - b).abs().max() / b.abs().max()).item()


def test_mask_built_before_a_graph_break_is_rewritten_and_checked():
    q, latent, kpe, w, valid = M.synthetic_site_inputs()
    mask = torch.where(valid, 0.0, MIN)
    compiled = torch.compile(model, backend="mla_dcp")
    WRITE.clear()
    out = compiled(q, latent, kpe, w, valid)
    assert C["mla_compile"][mla_attention.COUNTER] == 1 and C["mla_compile"][mla_attention.SKIP_COUNTER] == 0
    assert _err(out, _reference(q, latent, kpe, w, mask)) < 1e-5
    out = compiled(q, latent, kpe, w, ~valid | (torch.arange(24) == 0))  # other values, same graph
    assert _err(out, _reference(q, latent, kpe, w, torch.where(~valid | (torch.arange(24) == 0), 0.0, MIN))) < 1e-5
    assert C["mla_compile"][mask_origin.COUNTER] == 0
    # the eager region writes a bias into the proven mask: the check fails, the graph that assumes nothing about the
    # mask runs (absorbed with the mask as it is: exact)
    WRITE.append(-3.0)
    try:
        out = compiled(q, latent, kpe, w, valid)
    finally:
        WRITE.clear()
    biased = mask.clone()
    biased[..., -1] = -3.0
    assert _err(out, _reference(q, latent, kpe, w, biased)) < 1e-5
    assert C["mla_compile"][mask_origin.COUNTER] == 1
    assert C["mla_compile"][mla_attention.SKIP_COUNTER] == 0
    assert C["mla_compile"][mla_attention.DENSE_COUNTER] == 1  # the unchecked graph's site, counted and logged
    # back to a proven mask: the rewritten graph again
    out = compiled(q, latent, kpe, w, valid)
    assert C["mla_compile"][mask_origin.COUNTER] == 1
    assert _err(out, _reference(q, latent, kpe, w, mask)) < 1e-5


def test_mask_from_outside_the_compiled_code_is_not_assumed():
    """A float mask no graph of ours proved (the caller's, here a hard one too) is not read as valid tokens for the
    decode ops: the site is absorbed with the mask as it is, counted."""
    q, latent, kpe, w, valid = M.synthetic_site_inputs()
    mask = torch.where(valid, 0.0, MIN)
    out = torch.compile(outside_mask, backend="mla_dcp")(q, latent, kpe, w, mask)
    assert C["mla_compile"][mla_attention.COUNTER] == 0 and C["mla_compile"][mla_attention.SKIP_COUNTER] == 0
    assert C["mla_compile"][mla_attention.DENSE_COUNTER] == 1
    assert _err(out, _reference(q, latent, kpe, w, mask)) < 1e-5


def test_output_facts_only_for_hard_masks():
    """The producer side records exactly the outputs prove_mask proves (a bias is not a mask)."""
    def f(valid, bias):
        return torch.where(valid, 0.0, MIN), torch.where(valid, 0.0, -2.0), bias * 1.0

    gms = []

    def grab(gm, example_inputs):
        gms.append(gm)
        return gm.forward

    valid = torch.rand(2, 1, 1, 8) < 0.5
    torch.compile(f, backend=grab)(valid, torch.randn(2, 1, 1, 8))
    assert mask_origin.output_facts(gms[0]) == {0: (torch.float32, MIN)}


def _break_in_site(data_dependent: bool):
    def f(q, latent, kpe, w, valid):
        # between HF's K assembly and its attention: a data-dependent shape (glm5_next's `pool_keys[:, keep]`)
        # or a plain break
        between = (lambda: valid.nonzero()) if data_dependent else torch._dynamo.graph_break
        return M.mla_attention_site(q, latent, kpe, w, valid, impl="sdpa", between=between)
    return f


def test_break_between_expansion_and_attention_is_counted():
    q, latent, kpe, w, valid = M.synthetic_site_inputs()
    out = torch.compile(_break_in_site(False), backend="mla_dcp")(q, latent, kpe, w, valid)
    assert C["mla_compile"][mla_attention.COUNTER] == 0 and C["mla_compile"][mla_attention.SKIP_COUNTER] == 1
    ref = M.mla_attention_site(q.double(), latent.double(), kpe.double(), w.double(), valid, impl="sdpa")
    assert _err(out, ref) < 1e-5


def test_data_dependent_break_traced_is_rewritten():
    q, latent, kpe, w, valid = M.synthetic_site_inputs()
    ref = M.mla_attention_site(q.double(), latent.double(), kpe.double(), w.double(), valid, impl="sdpa")
    out = torch.compile(_break_in_site(True), backend="mla_dcp")(q, latent, kpe, w, valid)
    assert C["mla_compile"][mla_attention.SKIP_COUNTER] == 1  # default config: the nonzero breaks the graph
    assert _err(out, ref) < 1e-5
    torch._dynamo.reset()
    C.clear()
    with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True):
        out = torch.compile(_break_in_site(True), backend="mla_dcp")(q, latent, kpe, w, valid)
    assert C["mla_compile"][mla_attention.COUNTER] == 1 and C["mla_compile"][mla_attention.SKIP_COUNTER] == 0
    assert _err(out, ref) < 1e-5
