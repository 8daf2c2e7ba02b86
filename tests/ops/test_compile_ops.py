"""Every op under `torch.compile(backend="mla_dcp", fullgraph=True)`: no graph break, same result as eager,
one FX node per op (expecttest snapshot; EXPECTTEST_ACCEPT=1 to update). Plus the backend's entry point,
`options=` validation and `mode=`."""

from __future__ import annotations

import operator
import subprocess
import sys
import textwrap

import expecttest
import pytest
import torch
import torch._dynamo.testing

import mla_compile
import reference as ref

PS, H, R, P, Hi, Di, TOPK = 4, 2, 16, 8, 2, 8, 16
LENS = [9, 0, 4]


def fn(ckv_cache, kpe_cache, new_ckv, new_kpe, slots, q_nope, q_pe, block_table, seq_lens, q_idx, w_idx, k_idx):
    torch.ops.mla.cache_write(ckv_cache, kpe_cache, new_ckv, new_kpe, slots)
    out, lse = torch.ops.mla.decode(q_nope, q_pe, ckv_cache, kpe_cache, block_table, seq_lens, 0.25)
    sel = torch.ops.dsa.indexer_topk(q_idx, w_idx, k_idx, block_table, seq_lens, TOPK, 0.5)
    konly = torch.ops.dsa.k_only_indices(block_table, seq_lens, PS, TOPK)
    s_out, s_lse = torch.ops.mla.sparse_decode(q_nope, q_pe, ckv_cache, kpe_cache, sel, 0.25)
    m_out, m_lse = torch.ops.mla.merge_states(torch.stack([out, s_out]), torch.stack([lse, s_lse]))
    return out, lse, sel, konly, s_out, s_lse, m_out, m_lse


def make_inputs(seed=0):
    """Caches hold LENS tokens minus each request's last one; cache_write then appends those last tokens."""
    g = torch.Generator().manual_seed(seed)
    _, (c, k, ki), bt, sl, _ = ref.build_paged(LENS, PS, (R, P, Di), generator=g, shuffle=True, extra_cols=1)
    B = len(LENS)
    last = [b for b, n in enumerate(LENS) if n > 0]
    slots = torch.tensor([ref.request_slots(bt, PS, b, LENS[b])[-1] for b in last] + [-1], dtype=torch.int64)
    new_ckv = torch.stack([c.reshape(-1, R)[s] for s in slots[:-1].tolist()] + [torch.randn(R, generator=g)])
    new_kpe = torch.stack([k.reshape(-1, P)[s] for s in slots[:-1].tolist()] + [torch.randn(P, generator=g)])
    for s in slots[:-1].tolist():  # forget the last tokens; cache_write must put them back
        c.view(-1, R)[s] = float("nan")
        k.view(-1, P)[s] = float("nan")
    return (c, k, new_ckv, new_kpe, slots, torch.randn(B, H, R, generator=g), torch.randn(B, H, P, generator=g),
            bt, sl, torch.randn(B, Hi, Di, generator=g), torch.randn(B, Hi, generator=g), ki)


def clone_args(args):
    return tuple(a.clone() for a in args)


def assert_same(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        if x.is_floating_point():
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, equal_nan=False)
        else:
            assert torch.equal(x, y)


def node_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):  # Dynamo records the packet; fold overloads onto it
        target = target.overloadpacket
    if isinstance(target, torch._ops.OpOverloadPacket):
        return str(target).removeprefix("torch.ops.")
    if target is operator.getitem:
        return "getitem"
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__name__', target)}"


def op_nodes(gm: torch.fx.GraphModule) -> str:
    """Normalized, stable text of the graph's call_function nodes (getitems on op results folded in)."""
    lines = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            lines.append(node_name(n.target))
    return "\n".join(lines)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()


def test_every_op_compiles_fullgraph_and_matches_eager():
    args = make_inputs()
    eager_args, comp_args = clone_args(args), clone_args(args)
    want = fn(*eager_args)
    cnt = torch._dynamo.testing.CompileCounterWithBackend("mla_dcp")
    got = torch.compile(fn, backend=cnt, fullgraph=True)(*comp_args)
    assert cnt.frame_count == 1 and len(cnt.graphs) == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    assert_same(got, want)
    # the in-place cache write happened in the compiled run as well (compared NaN-aware: unused slots are NaN)
    torch.testing.assert_close(comp_args[0], eager_args[0], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(comp_args[1], eager_args[1], rtol=0, atol=0, equal_nan=True)
    # and it wrote what the unsplit reference expects: decode over the refilled cache == reference
    r_out, r_lse = ref.ref_decode(*comp_args[5:7], comp_args[0], comp_args[1], comp_args[7], comp_args[8], 0.25)
    assert ref.rel_err(got[0], r_out) < 1e-5 and ref.rel_err(got[1], r_lse, floor=1.0) < 1e-5
    assert not any(torch.isnan(t).any() for t in got if t.is_floating_point())

    # one node per op in the Dynamo graph
    expecttest.assert_expected_inline(op_nodes(cnt.graphs[0]), """\
mla.cache_write
mla.decode
dsa.indexer_topk
dsa.k_only_indices
mla.sparse_decode
torch.stack
torch.stack
mla.merge_states""")

    # a second call with new values reuses the compiled graph
    args2 = make_inputs(seed=1)
    e2, c2 = clone_args(args2), clone_args(args2)
    assert_same(torch.compile(fn, backend=cnt, fullgraph=True)(*c2), fn(*e2))
    assert cnt.frame_count == 1


def test_string_backend_fullgraph_matches_eager():
    args = make_inputs(seed=2)
    e, c = clone_args(args), clone_args(args)
    assert_same(torch.compile(fn, backend="mla_dcp", fullgraph=True)(*c), fn(*e))
    assert not torch._dynamo.utils.counters["graph_break"]


def test_backend_found_without_importing_package():
    """In a fresh interpreter the entry point makes `mla_dcp` visible and usable with no import of ours."""
    code = textwrap.dedent("""
        import sys, torch
        assert "mla_compile" not in sys.modules
        assert "mla_dcp" in torch._dynamo.list_backends(), torch._dynamo.list_backends()
        assert "mla_compile" not in sys.modules
        out = torch.compile(lambda x: x * 2 + 1, backend="mla_dcp")(torch.ones(3))
        assert out.tolist() == [3.0, 3.0, 3.0]
        assert hasattr(torch.ops.mla, "decode") and hasattr(torch.ops.dsa, "k_only_indices")
        print("OK")
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-3000:]


def test_unknown_option_lists_valid_keys():
    gm = torch.fx.symbolic_trace(lambda x: x + 1)
    with pytest.raises(ValueError, match=r"^options: unknown key 'bogus'.*mode.*rewrite_attention"):
        mla_compile.mla_dcp(gm, [torch.ones(2)], options={"bogus": 1})
    # through torch.compile: the same ValueError at the first call (backend.OptionsError passes Dynamo unwrapped)
    with pytest.raises(ValueError, match=r"^options: unknown key 'bogus'.*rewrite_attention"):
        torch.compile(lambda x: x + 1, backend="mla_dcp", options={"bogus": 1})(torch.ones(2))


def test_known_options_and_reduce_overhead_mode_accepted():
    # torch.compile itself refuses mode= and options= together, so one at a time
    f = torch.compile(lambda x: x * 3, backend="mla_dcp", mode="reduce-overhead")
    assert f(torch.ones(2)).tolist() == [3.0, 3.0]
    torch._dynamo.reset()
    g = torch.compile(lambda x: x * 5, backend="mla_dcp",
                      options={"rewrite_attention": False, "mode": "default", "max_autotune": False})
    assert g(torch.ones(2)).tolist() == [5.0, 5.0]
    with pytest.raises(ValueError, match="^mode"):
        mla_compile.mla_dcp(torch.fx.symbolic_trace(lambda x: x + 1), [torch.ones(2)], mode="no-such-mode")


def test_inductor_patches_cuda_defaults_then_mode_then_user():
    from mla_compile.backend import CUDA_INDUCTOR_DEFAULTS, BackendOptions, config_patches

    opts = BackendOptions()
    cuda = config_patches(opts, "reduce-overhead", {}, on_cuda=True)
    assert cuda["combo_kernels"] is True and cuda["triton.enable_pdl"] is True and cuda["triton.cudagraphs"] is True
    assert "combo_kernels" not in config_patches(opts, None, {}, on_cuda=False)  # CPU: Inductor's own defaults
    assert config_patches(opts, None, {"combo_kernels": False}, on_cuda=True)["combo_kernels"] is False
    assert set(CUDA_INDUCTOR_DEFAULTS) <= set(torch._inductor.config.get_config_copy())  # real Inductor keys
