"""The HF pass's physical slots of logical token positions (`attention_emit._paged_slots`): the general form
(`layout.page_slots`: block_table[b, t // PS] * PS + t % PS) and the one-page form it emits where every request's
positions [0, L) lie in its one page (a [B, 1] table of pages of >= L tokens: DSAStaticCache's FP8 layers), which
drops the per-element gather, division and remainder. Both checked against the definition on random tables."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

from mla_compile.passes import attention_emit as E
from mla_compile.passes._fx import Builder
from mla_compile.passes.attention_match import LatentSource

aten = torch.ops.aten


def _slots(B: int, L: int, pages: int, PS: int, bound, evaluate: bool = True):
    """(the emitted graph's targets, its slots, the definition's) for positions t [B, L] in [0, L) (evaluate
    False: the targets only)."""
    gen = torch.Generator().manual_seed(B * 1000 + pages * 10 + PS)
    table = torch.randperm(B * pages + 3, generator=gen)[:B * pages].view(B, pages).int()
    t = torch.randint(0, L, (B, L), generator=gen, dtype=torch.int32)
    g = fx.Graph()
    mode = FakeTensorMode()
    nodes = {}
    for name, real in (("table", table), ("ckv", torch.empty(B * pages + 3, PS, 8)), ("t", t)):
        nodes[name] = g.placeholder(name)
        nodes[name].meta["example_value"] = mode.from_tensor(real)
    anchor = g.output(None)
    b = Builder(g, anchor, mode, anchor)
    src = LatentSource(kind="paged", ckv=nodes["ckv"], kpe=nodes["ckv"], block_table=nodes["table"])
    out = E._paged_slots(b, nodes["t"], src, bound)
    anchor.args = (out,)
    targets = {n.target for n in g.nodes if n.op == "call_function"}
    if not evaluate:
        return targets, None, None
    got = fx.GraphModule(torch.nn.Module(), g)(table, torch.empty(0), t)
    want = table.long().gather(1, (t // PS).long()) * PS + t % PS
    return targets, got, want.int()


@pytest.mark.parametrize("B,L,pages,PS,bound,one_page", [
    (3, 40, 1, 40, 40, True),  # one page per request of exactly L tokens
    (2, 40, 1, 64, 40, True),  # a longer page
    (3, 40, 1, 40, None, False),  # no bound known: the general form
    (2, 40, 5, 8, 40, False),  # several pages a request
])
def test_paged_slots_match_the_definition(B, L, pages, PS, bound, one_page):
    targets, got, want = _slots(B, L, pages, PS, bound)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert (aten.gather.default not in targets) == one_page, targets
    assert (aten.remainder.Scalar not in targets) == one_page, targets


def test_a_page_shorter_than_the_positions_keeps_the_general_form():
    """Positions up to L - 1 in pages of fewer than L tokens would leave their page: the shortcut is not taken."""
    targets, _, _ = _slots(2, 40, 1, 32, 40, evaluate=False)
    assert aten.gather.default in targets


def test_builder_all_or_nothing_keeps_a_finished_emission_and_erases_a_failed_one():
    """A rewrite's nodes stay when its block ends and all go when it raises midway (the site as it was), the
    exception going on up."""
    g = fx.Graph()
    mode = FakeTensorMode()
    x = g.placeholder("x")
    x.meta["example_value"] = mode.from_tensor(torch.randn(3))
    anchor = g.output(x)
    before = [n.name for n in g.nodes]
    with pytest.raises(RuntimeError, match="midway"):
        with Builder(g, anchor, mode, anchor).all_or_nothing() as b:
            b.call(torch.add, b.call(torch.mul, x, 2), 1)
            raise RuntimeError("midway")
    assert [n.name for n in g.nodes] == before
    with Builder(g, anchor, mode, anchor).all_or_nothing() as b:
        y = b.call(torch.add, b.call(torch.mul, x, 2), 1)
    anchor.args = (y,)
    g.lint()
    assert [n.target for n in g.nodes if n.op == "call_function"] == [torch.mul, torch.add]
    assert torch.equal(fx.GraphModule(torch.nn.Module(), g)(torch.ones(3)), torch.full((3,), 3.0))
