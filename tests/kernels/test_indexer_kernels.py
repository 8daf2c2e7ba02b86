"""The DSA indexer's Triton kernels (mla_compile/kernels/dsa.py) on the CPU.

Under TRITON_INTERPRET=1 (one child process, tests/interpreter_child.py):
  * the key math of the logits kernel (`_order_key`) is a second implementation of `topk_order.order_keys`: its keys
    equal that definition bit for bit on every float32 bit pattern class (NaN with any sign and payload, +-inf, -0.0,
    denormals, +-max, ties) and index, and the keys the logits kernel writes equal `order_keys` of the scores it
    computes, invalid positions (NONE) included;
  * `indexer_topk` (both top-k selects: the radix select kernel and torch.topk + slots), a reused
    `indexer_topk_plan` and `k_only_indices`, of one and of S query tokens per request, equal the ops' CPU impls
    exactly, fuzzed
    (hypothesis): B 1-4, page sizes 1 / 16 / 64, lengths 0, < topk, == topk, > topk, block tables narrower and wider
    than topk, strided inputs, small-integer data (every score exact whatever the summation order, many ties).
On sm_90a ahead of time (tools/aot.py, no GPU): the kernels compile without spills and, launched with PDL, wait for
the previous kernel before any memory access.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

# its module fixture runs once: every test here on one xdist worker (README's test command: --dist loadgroup)
pytestmark = [pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
              pytest.mark.xdist_group("test_indexer_kernels")]

CHECKS = ["order_key_special_values", "order_key_fuzz", "logits_keys_are_order_keys", "indexer_topk_fuzz",
          "multi_token_fuzz", "dcp_local_candidates_fuzz",
          "plan_replays_new_inputs", "empty_and_narrow", "k_only_indices", "cuda_impl_on_cpu_tensors"]

# float32 bit patterns of every class the order definition treats specially (and neighbours of its boundaries)
SPECIAL_BITS = [0x00000000, 0x80000000,  # +0.0, -0.0 (one tie class)
                0x00000001, 0x80000001, 0x007FFFFF, 0x807FFFFF,  # denormals
                0x00800000, 0x80800000, 0x3F800000, 0xBF800000,  # smallest normals, +-1
                0x7F7FFFFF, 0xFF7FFFFF, 0x7F800000, 0xFF800000,  # +-max, +-inf (inf clamps onto max: a tie)
                0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FFFFFFF]  # NaNs: quiet, negative, signalling


def floats_of_bits(bits) -> torch.Tensor:
    """float32 tensor with exactly these bit patterns (ints in [0, 2^32))."""
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def tied_inputs(lens, PS, MP, Hi, Di, dtype=torch.float32, seed=0, device="cpu"):
    """(q [B, Hi, Di], weights float32 [B, Hi], k_cache [NP, PS, Di], block_table int32 [B, MP], seq_lens int32 [B])
    with small-integer values (every score exact in float32 whatever the order: many exact ties, and +-0.0 from
    negative weights). Each row has MP distinct shuffled pages; slots past a length hold NaN (a kernel reading
    them poisons its result)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    NP = B * MP + 2
    table = torch.randperm(NP, generator=g)[:B * MP].view(B, MP).to(torch.int32)
    k_cache = torch.full((NP, PS, Di), float("nan"))
    keys = torch.randint(-1, 2, (B, MP * PS, Di), generator=g).float()
    for b, n in enumerate(lens):
        t = torch.arange(n)
        k_cache[table[b, t // PS].long(), t % PS] = keys[b, :n]
    q = torch.randint(-1, 2, (B, Hi, Di), generator=g).float()
    w = torch.randint(-2, 3, (B, Hi), generator=g).float()
    lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(x.to(device) for x in (q.to(dtype), w, k_cache.to(dtype), table, lens))


def _every_other(x: torch.Tensor) -> torch.Tensor:
    """x's values as a view with last stride 2."""
    return torch.stack([x, torch.full_like(x, 7)], -1).flatten(-2)[..., ::2]


def strided_table(table, lens):
    """A column-major block table and the lengths as a column of a wider tensor, same values."""
    return table.T.contiguous().T, torch.stack([lens, lens + 3], 1)[:, 0]


def strided(q, w, k_cache, table, lens):
    """The same values as views with other strides (what a flexible-layout caller may hand over): q, weights and
    the cache with last stride 2, `strided_table`."""
    return (_every_other(q), _every_other(w), _every_other(k_cache), *strided_table(table, lens))


def special_score_inputs():
    """Inputs whose scores (sm_scale 1) hold NaN (where relu keeps it: not on the GPU, whose max drops NaN), +inf,
    -inf, zeros (-0.0 where the head sum keeps the sign) and ties: rows with weight +1 / -1 (the signs) on all 16
    heads (a head block with no masked head, whose +0.0 term would turn a sum of -0.0 into +0.0), a row with length
    <= topk (all NONE), an empty row; topk 4, page size 4, capacity 32."""
    Hi, Di, PS, MP = 16, 16, 4, 8
    lens = [30, 27, 4, 0]
    q, w, k_cache, table, seq_lens = tied_inputs(lens, PS, MP, Hi, Di, seed=3)
    q.zero_()
    q[:, :, 0], q[:, :, 1] = 1.0, 10.0
    w[:] = torch.tensor([1.0, -1.0, 1.0, 1.0])[:, None]
    # per token t: k . q = k[0] + 10 k[1]; k[1] = 3e38 overflows to inf, k[0] NaN gives NaN, k[0] < 0 gives relu 0
    rows = {0: [2.0, 0.0], 1: [float("nan"), 0.0], 2: [0.0, 3e38], 3: [-1.0, 0.0], 4: [2.0, 0.0], 5: [1.0, 0.0]}
    for b, n in enumerate(lens):
        for t in range(n):
            vec = torch.zeros(Di)
            vec[:2] = torch.tensor(rows[t % 6])
            k_cache[table[b, t // PS], t % PS] = vec
    return (q, w, k_cache, table, seq_lens), 4


# ------------------------------------------------------------------------------------------ the parent tests
@pytest.fixture(scope="module")
def verdicts():
    from interpreter_child import interpreter_verdict

    return interpreter_verdict(__file__)


@pytest.mark.parametrize("name", CHECKS)
def test_kernels_under_interpreter(verdicts, name):
    assert verdicts.get(name) == "ok", verdicts.get(name, "not run")


def _aot():
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tools/ is dev tooling
    from tools import aot

    if not aot.available():
        pytest.skip("triton's bundled ptxas is missing")
    return aot


def _build(kernel: str, pdl: bool) -> dict:
    """The kernel as `indexer_topk_plan` launches it for bf16 q [B, 64, 128] (contiguous operands), sm_90a."""
    from mla_compile.kernels import dsa as K

    aot = _aot()
    unit = dict(s_tp=1, s_lb=1)  # Triton specialises unit strides
    if kernel == "logits":
        ptrs = {"Q": "*bf16", "W": "*fp32", "K": "*bf16", "Table": "*i32", "Lens": "*i32", "Out": "*i64",
                "scale": "fp32"}
        return aot.compile_sm90(K._indexer_logits_kernel,
                                dict(BLOCK_HI=64, BLOCK_D=128, BLOCK_T=K._BLOCK_T, KEYS=True, PDL=pdl, s_qd=1, s_wh=1,
                                     s_kd=1, **unit),
                                ptrs, 4, 3, {"Q", "W", "K", "Table", "Lens", "Out", "s_qb", "s_qh", "s_kp", "s_ks"})
    if kernel in ("select slots", "select keys"):  # as launched for V3.2's indexer (topk 2048), rows of 4K-16K
        keys_out = kernel == "select keys"  # a DCP rank's candidates
        ptrs = {"Keys": "*i64", "Top": "*i64", "Table": "*i32", "Lens": "*i32", "Out": "*i64" if keys_out else "*i32"}
        return aot.compile_sm90(K._select_slots_kernel, dict(BLOCK=4096, KBLOCK=2048, KEYS_OUT=keys_out, PDL=pdl,
                                                             **unit), ptrs, 16, 3, set(ptrs), gluon=True)
    ptrs = {"Top": "*i64", "Table": "*i32", "Lens": "*i32", "Out": "*i32"}
    return aot.compile_sm90(K._slots_kernel, dict(BLOCK=1024, KEYED=kernel == "slots", PDL=pdl, **unit), ptrs, 4, 3,
                            set(ptrs), gluon=True)  # gluon=True: no dot-mode constexprs (no tl.dot here)


@pytest.mark.parametrize("kernel", ["logits", "slots", "identity slots", "select slots", "select keys"])
def test_kernels_compile_for_sm90_and_wait_under_pdl(kernel):
    """Compiled as launched, no spills; with PDL `griddepcontrol.wait` precedes every global access (the slots kernel
    follows torch.topk, whose output it reads), without PDL neither griddepcontrol instruction."""
    from test_kernel_codegen import _MEMORY_OP

    out = _build(kernel, True)
    assert out["spill_bytes"] == 0, out["registers"]
    ptx = out["ptx"]
    wait, first_access = ptx.find("griddepcontrol.wait"), _MEMORY_OP.search(ptx)
    assert first_access is not None and 0 <= wait < first_access.start()
    assert "griddepcontrol" not in _build(kernel, False)["ptx"]


def test_select_is_checked():
    """An unknown select, and radix past the topk its register sort takes, are ValueErrors naming `select` (raised
    while the plan is made: no kernel runs)."""
    from mla_compile.kernels import dsa as K

    args = tied_inputs([20, 5], 4, 6, 4, 16)
    with pytest.raises(ValueError, match="select: expected 'auto', 'radix' or 'torch', got 'heap'"):
        K.indexer_topk_plan(*args, 8, 0.5, "heap")
    big = K.RADIX_MAX_TOPK + 1
    args = tied_inputs([big + 3, 5], 4, -(-(big + 8) // 4), 4, 16)
    with pytest.raises(ValueError, match=f"select: 'radix' takes topk <= {K.RADIX_MAX_TOPK}"):
        K.indexer_topk_plan(*args, big, 0.5, "radix")


def test_keys_negative_zero_rule_is_an_integer_compare():
    """-0.0 -> +0.0 must survive compilation: done on the float's bits (an fadd of 0.0 may be folded away under
    no-signed-zeros), so the PTX holds the compare against 0x80000000 (-2147483648)."""
    ptx = _build("logits", False)["ptx"]
    assert re.search(r"setp\.eq\.[bs]32\s+%p\d+, %r\d+, -2147483648;", ptx), "no integer compare with -0.0's bits"


# ------------------------------------------------------------------------------------------ the child process
def _cpu_topk(args, topk, scale=0.5):
    return torch.ops.dsa.indexer_topk(*args, topk, scale)


def check_order_key_special_values():
    from mla_compile import topk_order

    bits = SPECIAL_BITS * 3  # ties: each value at three indices
    index = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1] + list(range(7, 7 + len(bits) - 5)), dtype=torch.int64)
    score = floats_of_bits(bits)
    got = keys_of(score, index)
    want = topk_order.order_keys(score, index, torch.ones_like(index, dtype=torch.bool))
    assert torch.equal(got, want), [(hex(b), int(i)) for b, i, x, y in zip(bits, index, got, want) if x != y]


def check_order_key_fuzz():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mla_compile import topk_order

    bit_pattern = st.one_of(st.sampled_from(SPECIAL_BITS), st.integers(0, 2**32 - 1))

    @settings(max_examples=200, deadline=None, database=None)
    @given(st.lists(st.tuples(bit_pattern, st.integers(0, 2**32 - 1)), min_size=1, max_size=80))
    def fuzz(pairs):
        score = floats_of_bits([p[0] for p in pairs])
        index = torch.tensor([p[1] for p in pairs], dtype=torch.int64)
        want = topk_order.order_keys(score, index, torch.ones_like(index, dtype=torch.bool))
        assert torch.equal(keys_of(score, index), want)

    fuzz()


def check_logits_keys_are_order_keys():
    """The logits kernel's keys vs `order_keys` of its own scores (same arithmetic, KEYS off): special scores,
    invalid positions (past a length, rows with length <= topk, an empty row) NONE, a strided call alike."""
    from mla_compile import topk_order
    from mla_compile.kernels import dsa as K

    args, topk = special_score_inputs()
    scores = K.indexer_scores(*args, 1.0, topk)
    T, lens = scores.shape[1], args[-1]
    valid = (torch.arange(T)[None, :] < lens[:, None]) & (lens[:, None] > topk)
    s = scores[valid]
    assert s.isnan().any() and (s == float("inf")).any() and (s == float("-inf")).any(), "special scores missing"
    # +0.0 only: the interpreter's tl.sum (NumPy's, from an identity of +0.0) never sums to -0.0; -0.0 reaches the
    # key math through `order_key_probe` above (and on the GPU, tests/gpu/test_indexer_topk_cuda.py)
    assert (s == 0).any(), "0.0 missing"
    assert scores[~valid].eq(float("-inf")).all()
    want = topk_order.order_keys(scores, torch.arange(T), valid)
    for call in (args, strided(*args)):
        assert torch.equal(K.indexer_keys(*call, 1.0, topk), want)
    # and the selection of those keys: the CPU op's
    got = K.indexer_topk(*args, topk, 1.0)
    assert torch.equal(got, _cpu_topk(args, topk, 1.0))


def _case(data):
    """Draw one indexer call: (lens, PS, MP, Hi, Di, dtype, topk, strided)."""
    from hypothesis import strategies as st

    PS = data.draw(st.sampled_from([1, 16, 64]), "PS")
    MP = data.draw(st.integers(1, max(1, 160 // PS)), "MP")
    cap = MP * PS
    topk = data.draw(st.integers(1, 40), "topk")
    kinds = data.draw(st.lists(st.sampled_from(["zero", "short", "equal", "long", "full"]), min_size=1, max_size=4),
                      "kinds")
    lens = []
    for kind in kinds:
        n = {"zero": 0, "short": data.draw(st.integers(1, max(1, topk - 1))), "equal": topk,
             "long": data.draw(st.integers(topk + 1, max(topk + 1, cap))), "full": cap}[kind]
        lens.append(min(n, cap))
    Hi = data.draw(st.sampled_from([1, 4, 16]), "Hi")
    Di = data.draw(st.sampled_from([8, 16, 24]), "Di")
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]), "dtype")
    return lens, PS, MP, Hi, Di, dtype, topk, data.draw(st.booleans(), "strided")


def check_indexer_topk_fuzz():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mla_compile.kernels import dsa as K

    @settings(max_examples=100, deadline=None, database=None)
    @given(st.data(), st.integers(0, 2**16))
    def fuzz(data, seed):
        lens, PS, MP, Hi, Di, dtype, topk, is_strided = _case(data)
        select = data.draw(st.sampled_from(["radix", "torch"]), "select")  # both top-k paths of the plan
        args = tied_inputs(lens, PS, MP, Hi, Di, dtype, seed)
        want = _cpu_topk(args, topk)
        got = K.indexer_topk(*(strided(*args) if is_strided else args), topk, 0.5, select)
        assert got.dtype == torch.int32 and torch.equal(got, want), (lens, topk, select, got, want)

    fuzz()


def check_multi_token_fuzz():
    """S query tokens per request as B*S query rows whose table row and tokens the kernels find (`_row_tokens`):
    `indexer_topk_plan` (both selects) and `k_only_plan` with n_query = S, over [B] lengths counting the S new
    tokens (0 or >= S), run on q [B, S, Hi, Di] / weights [B, S, Hi] as they are (the rows a view
    of them; last stride 2 when strided, with a column-major table), equal the ops' CPU impls exactly."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mla_compile.kernels import dsa as K

    @settings(max_examples=40, deadline=None, database=None)
    @given(st.data(), st.integers(0, 2**16))
    def fuzz(data, seed):
        lens, PS, MP, Hi, Di, dtype, topk, is_strided = _case(data)
        S = data.draw(st.integers(1, 4), "S")
        lens = [0 if n < S else n for n in lens]  # a request with S new tokens holds at least S
        B, g = len(lens), torch.Generator().manual_seed(seed)
        _, _, k_cache, table, seq_lens = tied_inputs(lens, PS, MP, Hi, Di, dtype, seed)
        q = torch.randint(-1, 2, (B, S, Hi, Di), generator=g).to(dtype)
        w = torch.randint(-2, 3, (B, S, Hi), generator=g).float()
        select = data.draw(st.sampled_from(["radix", "torch"]), "select")
        want = torch.ops.dsa.indexer_topk(q, w, k_cache, table, seq_lens, topk, 0.5)
        if is_strided:
            q, w, table = _every_other(q), _every_other(w), strided_table(table, seq_lens)[0]
        plan = K.indexer_topk_plan(q.reshape(B * S, Hi, Di), w.reshape(B * S, Hi), k_cache, table, seq_lens, topk,
                                   0.5, select, n_query=S, out_shape=(B, S, topk))
        got = plan(q, w, k_cache, table, seq_lens)
        assert got.shape == (B, S, topk) and torch.equal(got, want), (lens, S, topk, select, got, want)
        short = seq_lens.clamp(max=topk)  # k-only indexing: [B] lengths <= topk, still 0 or >= S
        short = torch.where(short < S, 0, short)
        want = torch.ops.dsa.k_only_indices(table, short, PS, topk, S)
        got = K.k_only_plan(table, short, PS, topk, S, (B, S, topk) if S > 1 else None)(table, short)
        assert torch.equal(got, want), (lens, S, topk, got, want)

    fuzz()


def check_dcp_local_candidates_fuzz():
    """`dsa::dcp_local_candidates` on the kernels (the logits kernel with the global index t * n + r, no row skipped;
    the radix select writing keys, or torch.topk) equals the op's CPU impl exactly: shards shorter than topk give
    all their keys, NONE-padded; tables narrower than topk; both selects."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mla_compile.kernels import dsa as K

    @settings(max_examples=60, deadline=None, database=None)
    @given(st.data(), st.integers(0, 2**16))
    def fuzz(data, seed):
        lens, PS, MP, Hi, Di, dtype, topk, is_strided = _case(data)
        n = data.draw(st.integers(1, 4), "dcp_size")
        r = data.draw(st.integers(0, n - 1), "dcp_rank")
        select = data.draw(st.sampled_from(["radix", "torch"]), "select")
        args = tied_inputs(lens, PS, MP, Hi, Di, dtype, seed)
        want = torch.ops.dsa.dcp_local_candidates(*args, topk, 0.5, n, r)
        call = strided(*args) if is_strided else args
        got = K.candidate_keys_plan(*call, topk, 0.5, n, r, select)(*call)
        assert got.dtype == torch.int64 and torch.equal(got, want), (lens, topk, n, r, select, got, want)

    fuzz()


def check_plan_replays_new_inputs():
    """One plan per signature, run on other tensors of that signature (new lengths, pages, keys, queries): each
    answer the CPU op's; a narrow table (T <= topk: the slots kernel alone) alike."""
    from mla_compile.kernels import dsa as K

    for select in ("radix", "torch"):
        for PS, MP, topk in ((16, 4, 20), (1, 48, 8), (64, 1, 64)):
            plan = None
            for seed, lens in enumerate(([50, 0, 20, 64], [3, 64, 64, 21], [0, 0, 0, 0], [64, 64, 64, 64])):
                args = tied_inputs([min(n, MP * PS) for n in lens], PS, MP, 4, 16, torch.bfloat16, seed=seed)
                plan = plan or K.indexer_topk_plan(*args, topk, 0.5, select)
                assert torch.equal(plan(*args), _cpu_topk(args, topk)), (PS, MP, topk, lens, select)


def check_empty_and_narrow():
    from mla_compile.kernels import dsa as K

    q, w, k_cache, table, lens = tied_inputs([0], 4, 2, 4, 16)
    none = K.indexer_topk(q[:0], w[:0], k_cache, table[:0], lens[:0], 8, 0.5)
    assert none.shape == (0, 8) and none.dtype == torch.int32
    zero_pages = K.indexer_topk(q, w, k_cache, table[:, :0], lens, 8, 0.5)  # capacity 0: all -1
    assert zero_pages.tolist() == [[-1] * 8]
    args = tied_inputs([7, 8], 4, 2, 4, 16, seed=2)  # capacity 8 == topk: identity rows, no keys
    assert torch.equal(K.indexer_topk(*args, 8, 0.5), _cpu_topk(args, 8))


def check_k_only_indices():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mla_compile.kernels import dsa as K

    @settings(max_examples=100, deadline=None, database=None)
    @given(st.data(), st.integers(0, 2**16))
    def fuzz(data, seed):
        lens, PS, MP, Hi, Di, dtype, topk, is_strided = _case(data)
        _, _, _, table, seq_lens = tied_inputs(lens, PS, MP, 1, 8, seed=seed)
        seq_lens = seq_lens.clamp(max=topk)
        want = torch.ops.dsa.k_only_indices(table, seq_lens, PS, topk)
        call = strided_table(table, seq_lens) if is_strided else (table, seq_lens)
        assert torch.equal(K.k_only_indices(*call, PS, topk), want)

    fuzz()


def check_cuda_impl_on_cpu_tensors():
    """The op's CUDA impl (ops/dsa.py) called with CPU tensors: `Plans` keeps no plan for them, so each call checks,
    makes its plan through kernels/dispatch.py and runs it (the interpreter). q [B, Hi, Di] and q [B, S, Hi, Di]
    (one row per query token) equal the CPU op; a bad argument still raises."""
    from mla_compile.ops import dsa as dsa_ops

    args = tied_inputs([70, 0, 19, 20, 3], 16, 5, 4, 16, torch.bfloat16, seed=7)
    assert torch.equal(dsa_ops._indexer_topk_cuda(*args, 20, 0.5), _cpu_topk(args, 20))
    g = torch.Generator().manual_seed(8)
    S = 3
    q4 = torch.randint(-1, 2, (5, S, 4, 16), generator=g).to(torch.bfloat16)
    w4 = torch.randint(-2, 3, (5, S, 4), generator=g).float()
    args4 = (q4, w4, *args[2:])
    got = dsa_ops._indexer_topk_cuda(*args4, 20, 0.5)
    assert got.shape == (5, S, 20) and torch.equal(got, _cpu_topk(args4, 20))
    assert len(dsa_ops._PLANS._plans) == 0
    try:
        dsa_ops._indexer_topk_cuda(*args[:4], args[4].long(), 20, 0.5)
    except ValueError as e:
        assert str(e).startswith("seq_lens"), e
    else:
        raise AssertionError("int64 seq_lens passed the check")


def keys_of(score: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int64 `dsa._order_key` of 1-D score float32 / index int64 (one device), through `order_key_probe`."""
    out = torch.empty(score.shape, dtype=torch.int64, device=score.device)
    order_key_probe[((score.numel() + 63) // 64,)](score, index, out, score.numel(), BLOCK=64)
    return out


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from mla_compile.kernels.dsa import _order_key

    @triton.jit
    def order_key_probe(S, I, Out, N, BLOCK: tl.constexpr):
        """Out[i] = dsa._order_key(S[i], I[i]): the kernels' key math alone (a test kernel)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < N
        key = _order_key(tl.load(S + offs, mask=m, other=0.0), tl.load(I + offs, mask=m, other=0))
        tl.store(Out + offs, key, mask=m)


def _child():
    from test_triton_interpret import run_checks

    import mla_compile  # noqa: F401  (registers the ops: the CPU impls are the references)

    run_checks(globals(), CHECKS, tb_limit=8)


if __name__ == "__main__":
    _child()
