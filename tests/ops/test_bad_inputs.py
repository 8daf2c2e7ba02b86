"""Bad inputs raise ValueError whose message starts with the offending argument's name.

Metadata errors (dtype, dims, page size, device) are also raised by the fake impls, i.e. at trace time;
data errors (index ranges, lengths) are checked eagerly on CPU. Mixed devices are simulated with "meta".
"""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import mla_compile  # noqa: F401
import reference as ref

B, H, R, P, PS, Hi, Di = 2, 3, 8, 4, 4, 2, 6
LENS = [5, 0]


def base():
    g = torch.Generator().manual_seed(0)
    _, (c, k, ki), bt, sl, num_pages = ref.build_paged(LENS, PS, (R, P, Di), generator=g, shuffle=True,
                                                       extra_cols=1, garbage_unused=False)
    return dict(
        decode=dict(q_nope=torch.randn(B, H, R), q_pe=torch.randn(B, H, P), ckv_cache=c, kpe_cache=k,
                    block_table=bt, seq_lens=sl, sm_scale=0.5),
        sparse_decode=dict(q_nope=torch.randn(B, H, R), q_pe=torch.randn(B, H, P), ckv_cache=c, kpe_cache=k,
                           indices=torch.tensor([[0, -1, 3], [-1, -1, -1]], dtype=torch.int32), sm_scale=0.5),
        merge_states=dict(outs=torch.randn(2, B, H, R), lses=torch.randn(2, B, H)),
        cache_write=dict(ckv_cache=c.clone(), kpe_cache=k.clone(), ckv=torch.randn(3, R), kpe=torch.randn(3, P),
                         slots=torch.tensor([0, -1, 5])),
        indexer_topk=dict(q=torch.randn(B, Hi, Di), weights=torch.randn(B, Hi), k_cache=ki, block_table=bt,
                          seq_lens=sl, topk=4, sm_scale=0.5),
        k_only_indices=dict(block_table=bt, seq_lens=sl, page_size=PS, topk=8),
        dcp_local_candidates=dict(q=torch.randn(B, Hi, Di), weights=torch.randn(B, Hi), k_cache=ki, block_table=bt,
                                  local_lens=sl, topk=4, sm_scale=0.5, dcp_size=2, dcp_rank=1),
        fused_linear=dict(x=torch.randn(B, 1, 16), weights=[torch.randn(8, 16), torch.randn(4, 16)]),
        linear_partials=dict(x=torch.randn(B, 16), weights=[torch.randn(8, 16), torch.randn(4, 16)], splits=2),
        per_head_linear=dict(x=torch.randn(B, H, 16), weight=torch.randn(H, 8, 16)),
    ), num_pages


OPS = dict(decode=torch.ops.mla.decode, sparse_decode=torch.ops.mla.sparse_decode,
           merge_states=torch.ops.mla.merge_states, cache_write=torch.ops.mla.cache_write,
           indexer_topk=torch.ops.dsa.indexer_topk, k_only_indices=torch.ops.dsa.k_only_indices,
           dcp_local_candidates=torch.ops.dsa.dcp_local_candidates,
           fused_linear=torch.ops.mla.fused_linear, linear_partials=torch.ops.mla.linear_partials,
           per_head_linear=torch.ops.mla.per_head_linear)

BASE, NUM_PAGES = base()
CAP = BASE["decode"]["block_table"].shape[1] * PS  # block table capacity


def f32(*s):
    return torch.randn(*s)


def with_entry(t, idx, v):
    t = t.clone()
    t[idx] = v
    return t


def used_page(bt):  # (row, col) of a page request 0 uses
    return (0, 0)


BT, SL = BASE["decode"]["block_table"], BASE["decode"]["seq_lens"]
BAD_BT_HI = with_entry(BT, used_page(BT), NUM_PAGES)
BAD_BT_LO = with_entry(BT, used_page(BT), -1)
META = torch.device("meta")

# (op, {arg: bad value}, expected name, metadata-only?)  metadata-only cases are also checked in fake mode
CASES = [
    # ---- decode: wrong dtype
    ("decode", dict(q_nope=torch.randint(0, 3, (B, H, R))), "q_nope", True),
    ("decode", dict(q_pe=f32(B, H, P).half()), "q_pe", True),
    ("decode", dict(ckv_cache=BASE["decode"]["ckv_cache"].bfloat16()), "ckv_cache", True),
    ("decode", dict(kpe_cache=BASE["decode"]["kpe_cache"].double()), "kpe_cache", True),
    ("decode", dict(block_table=BT.long()), "block_table", True),
    ("decode", dict(seq_lens=SL.long()), "seq_lens", True),
    # ---- decode: mismatched dims
    ("decode", dict(q_nope=f32(B, R)), "q_nope", True),
    ("decode", dict(q_pe=f32(B + 1, H, P)), "q_pe", True),
    ("decode", dict(q_pe=f32(B, H + 1, P)), "q_pe", True),
    ("decode", dict(ckv_cache=f32(NUM_PAGES, PS, R + 1)), "ckv_cache", True),
    ("decode", dict(kpe_cache=f32(NUM_PAGES, PS, P + 1)), "kpe_cache", True),
    ("decode", dict(block_table=BT[:1]), "block_table", True),
    ("decode", dict(block_table=BT[0]), "block_table", True),
    ("decode", dict(seq_lens=SL[:1]), "seq_lens", True),
    # ---- decode: page size / page count mismatch between the two caches
    ("decode", dict(kpe_cache=f32(NUM_PAGES // 2, PS * 2, P)), "kpe_cache", True),
    ("decode", dict(kpe_cache=f32(NUM_PAGES + 1, PS, P)), "kpe_cache", True),
    # ---- decode: data
    ("decode", dict(block_table=BAD_BT_HI), "block_table", False),
    ("decode", dict(block_table=BAD_BT_LO), "block_table", False),
    ("decode", dict(seq_lens=torch.tensor([CAP + 1, 0], dtype=torch.int32)), "seq_lens", False),
    ("decode", dict(seq_lens=torch.tensor([-1, 0], dtype=torch.int32)), "seq_lens", False),
    ("decode", dict(sm_scale=float("nan")), "sm_scale", True),
    ("decode", dict(sm_scale=float("inf")), "sm_scale", True),
    ("decode", dict(sm_scale=float("-inf")), "sm_scale", True),
    # ---- decode: no latent (R = 0; a rope width P = 0 is rope-less MLA, accepted: tests/ops/test_rope_less.py)
    ("decode", dict(q_nope=f32(B, H, 0), ckv_cache=f32(NUM_PAGES, PS, 0)), "q_nope", True),
    ("decode", dict(q_nope=f32(B, H, 0), ckv_cache=f32(NUM_PAGES, PS, 0), q_pe=f32(B, H, 0),
                    kpe_cache=f32(NUM_PAGES, PS, 0)), "q_nope", True),
    # ---- decode: mixed devices
    ("decode", dict(block_table=BT.to(META)), "block_table", True),
    ("decode", dict(q_nope=f32(B, H, R).to(META)), "q_nope", True),
    ("decode", dict(ckv_cache=BASE["decode"]["ckv_cache"].to(META)), "ckv_cache", True),
    # ---- sparse_decode
    ("sparse_decode", dict(indices=torch.zeros(B, 3, dtype=torch.int64)), "indices", True),
    ("sparse_decode", dict(indices=torch.zeros(B + 1, 3, dtype=torch.int32)), "indices", True),
    ("sparse_decode", dict(indices=torch.zeros(B, dtype=torch.int32)), "indices", True),
    ("sparse_decode", dict(q_pe=f32(B, H, P).bfloat16()), "q_pe", True),
    ("sparse_decode", dict(kpe_cache=f32(NUM_PAGES, PS + 1, P)), "kpe_cache", True),
    ("sparse_decode", dict(indices=torch.tensor([[NUM_PAGES * PS, 0, 0], [0, 0, 0]], dtype=torch.int32)),
     "indices", False),
    ("sparse_decode", dict(indices=torch.tensor([[-2, 0, 0], [0, 0, 0]], dtype=torch.int32)), "indices", False),
    ("sparse_decode", dict(indices=torch.zeros(B, 3, dtype=torch.int32, device=META)), "indices", True),
    ("sparse_decode", dict(sm_scale=float("inf")), "sm_scale", True),
    ("sparse_decode", dict(q_nope=f32(B, H, 0), ckv_cache=f32(NUM_PAGES, PS, 0)), "q_nope", True),
    ("sparse_decode", dict(q_pe=f32(B, H, 0)), "kpe_cache", True),  # P = 0 query, P > 0 cache
    # ---- merge_states
    ("merge_states", dict(lses=torch.randn(2, B, H).double()), "lses", True),
    ("merge_states", dict(lses=torch.randn(2, B, H).bfloat16()), "lses", True),
    ("merge_states", dict(outs=torch.randint(0, 2, (2, B, H, R))), "outs", True),
    ("merge_states", dict(lses=torch.randn(3, B, H)), "lses", True),
    ("merge_states", dict(lses=torch.randn(2, B, H + 1)), "lses", True),
    ("merge_states", dict(outs=f32(B, H, R), lses=torch.randn(B, H)), "outs", True),
    ("merge_states", dict(outs=f32(0, B, H, R), lses=torch.randn(0, B, H)), "outs", True),
    ("merge_states", dict(lses=torch.randn(2, B, H, device=META)), "lses", True),
    # ---- cache_write
    ("cache_write", dict(slots=torch.tensor([0, -1, 5], dtype=torch.int32)), "slots", True),
    ("cache_write", dict(ckv=f32(3, R).bfloat16()), "ckv", True),
    ("cache_write", dict(kpe=f32(3, P).half()), "kpe", True),
    ("cache_write", dict(ckv=f32(3, R + 1)), "ckv", True),
    ("cache_write", dict(kpe=f32(3, P + 1)), "kpe", True),
    ("cache_write", dict(kpe=f32(2, P)), "kpe", True),
    ("cache_write", dict(slots=torch.tensor([0, 1])), "slots", True),
    ("cache_write", dict(kpe_cache=f32(NUM_PAGES, PS + 1, P)), "kpe_cache", True),
    ("cache_write", dict(ckv_cache=f32(NUM_PAGES, R, PS).transpose(1, 2)), "ckv_cache", True),
    ("cache_write", dict(slots=torch.tensor([0, -1, NUM_PAGES * PS])), "slots", False),
    ("cache_write", dict(slots=torch.tensor([0, -2, 1])), "slots", False),
    ("cache_write", dict(ckv=f32(3, R).to(META)), "ckv", True),
    ("cache_write", dict(ckv_cache=f32(NUM_PAGES, PS, 0), ckv=f32(3, 0)), "ckv_cache", True),
    ("cache_write", dict(kpe=f32(3, 0)), "kpe", True),  # P = 0 tokens, P > 0 cache
    # ---- indexer_topk
    ("indexer_topk", dict(topk=0), "topk", True),
    ("indexer_topk", dict(topk=-3), "topk", True),
    ("indexer_topk", dict(weights=torch.randn(B, Hi).half()), "weights", True),
    ("indexer_topk", dict(weights=torch.randn(B, Hi + 1)), "weights", True),
    ("indexer_topk", dict(q=torch.randint(0, 2, (B, Hi, Di))), "q", True),
    ("indexer_topk", dict(k_cache=f32(NUM_PAGES, PS, Di + 1)), "k_cache", True),
    ("indexer_topk", dict(k_cache=f32(NUM_PAGES, PS, Di).bfloat16()), "k_cache", True),
    ("indexer_topk", dict(block_table=BT.long()), "block_table", True),
    ("indexer_topk", dict(seq_lens=SL[:1]), "seq_lens", True),
    ("indexer_topk", dict(block_table=BAD_BT_HI), "block_table", False),
    ("indexer_topk", dict(seq_lens=torch.tensor([CAP + 1, 0], dtype=torch.int32)), "seq_lens", False),
    ("indexer_topk", dict(seq_lens=torch.tensor([0, -4], dtype=torch.int32)), "seq_lens", False),
    ("indexer_topk", dict(weights=torch.randn(B, Hi, device=META)), "weights", True),
    ("indexer_topk", dict(sm_scale=float("-inf")), "sm_scale", True),
    ("indexer_topk", dict(block_table=BAD_BT_LO), "block_table", False),
    # ---- dcp_local_candidates (indexer_topk's checks with this shard's lengths, and the group's ints)
    ("dcp_local_candidates", dict(dcp_rank=2), "dcp_rank", True),
    ("dcp_local_candidates", dict(dcp_rank=-1), "dcp_rank", True),
    ("dcp_local_candidates", dict(dcp_size=0), "dcp_size", True),
    ("dcp_local_candidates", dict(topk=0), "topk", True),
    ("dcp_local_candidates", dict(q=torch.randn(B, 1, Hi, Di)), "q", True),
    ("dcp_local_candidates", dict(weights=torch.randn(B, Hi + 1)), "weights", True),
    ("dcp_local_candidates", dict(local_lens=torch.tensor([CAP + 1, 0], dtype=torch.int32)), "local_lens", False),
    ("dcp_local_candidates", dict(local_lens=SL[:1]), "local_lens", True),
    # ---- k_only_indices
    ("k_only_indices", dict(topk=0), "topk", True),
    ("k_only_indices", dict(topk=-1), "topk", True),
    ("k_only_indices", dict(page_size=0), "page_size", True),
    ("k_only_indices", dict(block_table=BT.long()), "block_table", True),
    ("k_only_indices", dict(seq_lens=SL[:1]), "seq_lens", True),
    ("k_only_indices", dict(seq_lens=SL.long()), "seq_lens", True),
    ("k_only_indices", dict(seq_lens=torch.tensor([9, 0], dtype=torch.int32)), "seq_lens", False),  # > topk 8
    ("k_only_indices", dict(seq_lens=torch.tensor([-1, 0], dtype=torch.int32)), "seq_lens", False),
    ("k_only_indices", dict(seq_lens=torch.tensor([CAP + 1, 0], dtype=torch.int32), topk=CAP + 1), "seq_lens",
     False),
    ("k_only_indices", dict(seq_lens=SL.to(META)), "seq_lens", True),
    ("k_only_indices", dict(block_table=BAD_BT_LO), "block_table", False),  # would return negative slots
    ("k_only_indices", dict(block_table=with_entry(BT, used_page(BT), 2**30)), "block_table", False),  # int32 wrap
    # ---- fused_linear
    ("fused_linear", dict(x=torch.randint(0, 2, (B, 1, 16))), "x", True),
    ("fused_linear", dict(weights=[]), "weights", True),
    ("fused_linear", dict(weights=[f32(8, 16), f32(4, 15)]), "weights[1]", True),
    ("fused_linear", dict(weights=[f32(8, 16).double()]), "weights[0]", True),
    ("fused_linear", dict(weights=[f32(2, 8, 16)]), "weights[0]", True),
    # ---- linear_partials
    ("linear_partials", dict(x=f32(B, 1, 16)), "x", True),
    ("linear_partials", dict(splits=0), "splits", True),
    ("linear_partials", dict(splits=65), "splits", True),
    ("linear_partials", dict(weights=[f32(8, 15)]), "weights[0]", True),
    # ---- per_head_linear
    ("per_head_linear", dict(x=f32(B, 16)), "x", True),
    ("per_head_linear", dict(x=torch.randint(0, 2, (B, H, 16))), "x", True),
    ("per_head_linear", dict(weight=f32(H, 8, 16).double()), "weight", True),
    ("per_head_linear", dict(weight=f32(8, 16)), "weight", True),
    ("per_head_linear", dict(weight=f32(H + 1, 8, 16)), "weight", True),
    ("per_head_linear", dict(weight=f32(H, 8, 15)), "weight", True),
    ("per_head_linear", dict(weight=f32(H, 8, 16).to(META)), "weight", True),
]


def call(op_name, bad):
    args = dict(BASE[op_name])
    args.update(bad)
    return OPS[op_name](**args)


@pytest.mark.parametrize("op_name,bad,name,meta", CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_bad_input_raises_value_error_naming_the_argument(op_name, bad, name, meta):
    with pytest.raises(ValueError, match=f"^{re.escape(name)}: "):
        call(op_name, bad)


@pytest.mark.parametrize("op_name,bad,name,meta", [c for c in CASES if c[3] and not any(
    isinstance(v, torch.Tensor) and v.device.type == "meta" for v in c[1].values())],
    ids=lambda v: v if isinstance(v, str) else "")
def test_bad_metadata_raises_in_fake_mode(op_name, bad, name, meta):
    """Fake impls validate too, so a bad call fails at trace time with the same message."""
    args = dict(BASE[op_name])
    args.update(bad)
    with FakeTensorMode() as mode:
        fake = torch.utils._pytree.tree_map_only(torch.Tensor, mode.from_tensor, args)
        with pytest.raises(ValueError, match=f"^{re.escape(name)}: "):
            OPS[op_name](**fake)


@pytest.mark.parametrize("op_name", list(OPS))
def test_base_inputs_are_valid(op_name):
    """The cases above differ from a valid call only in the named argument."""
    call(op_name, {})


def test_unused_block_table_entries_are_not_checked():
    """Entries past a request's last page are never read, so garbage there is fine."""
    bt = with_entry(BT, (1, 0), 10**6)  # request 1 has length 0
    torch.ops.mla.decode(**{**BASE["decode"], "block_table": bt})


def test_k_only_slots_up_to_the_int32_limit_are_returned():
    """The int32 check is exact: a page whose last used slot is 2^31 - 1 is accepted (and returned exactly),
    one token more on it is refused."""
    page = (2**31 - 1) // PS  # slots page * PS .. page * PS + PS - 1 = 2^31 - 1
    bt = torch.tensor([[page], [0]], dtype=torch.int32)
    got = torch.ops.dsa.k_only_indices(bt, torch.tensor([PS, 0], dtype=torch.int32), PS, PS)
    assert got[0].tolist() == [page * PS + t for t in range(PS)] and got[0, -1] == 2**31 - 1
    with pytest.raises(ValueError, match="^block_table: .*int32"):
        torch.ops.dsa.k_only_indices(torch.tensor([[page + 1], [0]], dtype=torch.int32),
                                     torch.tensor([1, 0], dtype=torch.int32), PS, PS)


# ------------------------------------------------------------------------------------- backend options
@pytest.mark.parametrize("options,match", [
    ({"rewrite_attention": "no"}, r"^options: 'rewrite_attention' must be a bool .*'no' \(str\)"),
    ({"rewrite_attention": 0}, r"^options: 'rewrite_attention' must be a bool"),
    ({"rewrite_attention": None}, r"^options: 'rewrite_attention' must be a bool"),
    ({"fuse_linears": True}, r"^options: 'fuse_linears' must be one of auto, always, never"),
    ({"fuse_linears": ["auto"]}, r"^options: 'fuse_linears' must be one of"),
    ({"mode": 1}, r"^options: 'mode' must be a str or None"),
    ({"mode": "fastest"}, r"^options: mode: unknown mode 'fastest'"),
    ({"bogus": 1}, r"^options: unknown key 'bogus'.*rewrite_attention"),
    ([("rewrite_attention", False)], r"^options: expected a dict, got list"),
])
def test_bad_backend_options_raise_value_error(options, match):
    from mla_compile.backend import OptionsError, parse_options

    with pytest.raises(OptionsError, match=match) as info:
        parse_options(options)
    assert isinstance(info.value, ValueError)


def test_good_backend_options_parse():
    from mla_compile.backend import BackendOptions, parse_options

    opts, inductor = parse_options({"rewrite_attention": False, "fuse_linears": "never", "mode": "reduce-overhead",
                                    "max_autotune": False})
    assert opts == BackendOptions(mode="reduce-overhead", rewrite_attention=False, fuse_linears="never")
    assert inductor == {"max_autotune": False}
    assert parse_options(None) == (BackendOptions(), {})


@pytest.mark.parametrize("fullgraph", [True, False])
def test_bad_option_through_torch_compile_is_a_value_error_at_the_first_call(fullgraph):
    """torch.compile() hands options to a backend only when it compiles (the first call); what the user sees
    there is our ValueError itself, not Dynamo's BackendCompilerFailed wrapper (README, "Using it")."""
    from mla_compile.backend import OptionsError

    torch._dynamo.reset()
    f = torch.compile(lambda x: x + 1, backend="mla_dcp", fullgraph=fullgraph, options={"rewrite_attention": "no"})
    with pytest.raises(OptionsError, match=r"^options: 'rewrite_attention' must be a bool"):
        f(torch.ones(2))
    torch._dynamo.reset()
