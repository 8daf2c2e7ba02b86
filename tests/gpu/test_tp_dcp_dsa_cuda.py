"""Issue 28 on one GPU (n = 1 through the same code): the indexer's tie rule on CUDA, the DCP indexer's pieces under
CUDA-graph capture (no host sync), and an HF V3.2 model sharded with `init_dcp(tp_size=1)` + `shard_mla_heads`
over `MLAPagedCache(dcp=...)` compiled with mode="reduce-overhead" crossing index_topk (dense then sparse graph).
Multi-GPU TP x DCP waits for a machine with several GPUs (the gloo tests cover the collectives on CPU)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DI, HI, PS = 128, 64, 64


def _tied(seed: int, lens: list[int]):
    """Small-integer keys / queries / weights: every score exact in float32 whatever the order, many exact ties."""
    from mla_compile import paged

    g = torch.Generator().manual_seed(seed)
    keys = [torch.randint(-1, 2, (L, DI), generator=g).float() for L in lens]
    pb = paged.fill_paged(keys, [torch.zeros(L, 0) for L in lens], PS, generator=g)
    q = torch.randint(-1, 2, (len(lens), HI, DI), generator=g).float()
    w = torch.randint(0, 3, (len(lens), HI), generator=g).float()
    return pb, q, w


def _tokens(idx: torch.Tensor, table: torch.Tensor) -> list:
    """Selected slots -> sorted logical token indices, per request. A table row's unused tail may repeat a page id
    of the row (padding): the first occurrence is the page's place."""
    out = []
    for b, row in enumerate(idx.cpu()):
        page_of = {}
        for j, p in enumerate(table[b].cpu().tolist()):
            page_of.setdefault(p, j)
        out.append(sorted(page_of[int(s) // PS] * PS + int(s) % PS for s in row if s >= 0))
    return out


@pytest.mark.parametrize("topk", [16, 256])
def test_cuda_indexer_topk_breaks_ties_like_cpu(topk):
    lens = [3000, 700, 40, 0, 2049]
    pb, q, w = _tied(0, lens)
    cpu = torch.ops.dsa.indexer_topk(q, w, pb.ckv_cache, pb.block_table, pb.seq_lens, topk, 0.0625)
    dev = [t.cuda() for t in (q, w, pb.ckv_cache, pb.block_table, pb.seq_lens)]
    gpu = torch.ops.dsa.indexer_topk(*dev, topk, 0.0625)
    assert _tokens(gpu, pb.block_table) == _tokens(cpu, pb.block_table)
    one = torch.ops.dsa.dcp_indexer_topk(*dev, topk, 0.0625, 1, 0, "")  # dcp_size 1: the same op
    assert torch.equal(one, gpu)


def test_dcp_indexer_pieces_capture_in_a_cuda_graph():
    """Two simulated ranks' local candidates, the global top-k and the owned slots, captured once and replayed with
    new lengths: equal to the single-rank selection (no host sync anywhere, else capture fails)."""
    from mla_compile import paged, topk_order
    from mla_compile.ops.dcp_dsa import local_candidates, owned_slots

    n, topk, lens = 2, 64, [900, 300, 77]
    g = torch.Generator().manual_seed(1)
    keys = [torch.randint(-1, 2, (L, DI), generator=g).float() for L in lens]
    q = torch.randint(-1, 2, (3, HI, DI), generator=g).float().cuda()
    w = torch.randint(0, 3, (3, HI), generator=g).float().cuda()
    shards = [paged.fill_sharded(keys, [torch.zeros(L, 0) for L in lens], PS, n, r, generator=g) for r in range(n)]
    shards = [(s.ckv_cache.cuda(), s.block_table.cuda()) for s in shards]
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")

    def step():
        from mla_compile import layout

        cands = [local_candidates(q, w, kc, bt, layout.local_lens(seq, n, r), topk, 0.0625, n, r)
                 for r, (kc, bt) in enumerate(shards)]
        win = topk_order.top_keys(torch.cat(cands, 1), topk)
        return [owned_slots(win, bt, PS, n, r) for r, (_, bt) in enumerate(shards)]

    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    full = paged.fill_paged(keys, [torch.zeros(L, 0) for L in lens], PS, generator=g)
    for new in ([900, 300, 77], [512, 200, 64]):  # new lengths, the same graph (lengths live on the device)
        seq.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ref = torch.ops.dsa.indexer_topk(q.cpu(), w.cpu(), full.ckv_cache, full.block_table,
                                         torch.tensor(new, dtype=torch.int32), topk, 0.0625)
        want = _tokens(ref, full.block_table)
        got = [sorted(t * n + r for r, o in enumerate(outs) for t in _tokens(o, shards[r][1])[b])
               for b in range(3)]
        assert got == want


def test_hf_v32_tp1_dcp1_reduce_overhead_matches_eager():
    import copy
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import hf_models as M
    from mla_compile.distributed import init_dcp
    from mla_compile.integrations.hf import MLAPagedCache
    from mla_compile.integrations.tp import shard_mla_heads
    from transformers import StaticCache

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    grp = init_dcp(tp_size=1, dcp_size=1, device="cuda")
    model = M.deepseek_v32(num_layers=2, heads=16, index_topk=32).cuda()
    T, steps = 20, 40  # kv lengths 21 .. 60: dense graph, then sparse
    L = T + steps + 4
    ids, mask = M.batch(T=T, L=L)
    ids, mask = ids.cuda(), mask.cuda()
    ref_t, ref_l = M.greedy(model, model, ids, mask, StaticCache(config=model.config, max_cache_len=L), steps)
    sharded = shard_mla_heads(copy.deepcopy(model), grp)
    compiled = torch.compile(sharded, backend="mla_dcp", mode="reduce-overhead", fullgraph=True)
    c_t, c_l = M.greedy(compiled, sharded, ids, mask, MLAPagedCache(sharded.config, L, page_size=16, dcp=grp), steps,
                        prefill=sharded)
    assert torch.equal(c_t, ref_t)
    assert M.rel_err(c_l, ref_l) < 1e-3
    c = torch._dynamo.utils.counters["mla_compile"]
    assert c["dsa_index_mask_dropped"] >= 1 and c["dsa_sparse_rewritten"] >= 1, dict(c)
