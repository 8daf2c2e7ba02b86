"""Mixed DSA batch: rows with kv_len <= topk skip the indexer logits inside `dsa::indexer_topk`."""

import pytest
import torch

import mla_compile  # noqa: F401
import reference as ref

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("PS", [1, 16, 64])
def test_short_rows_take_identity_slots_without_logits(device, PS):
    g = torch.Generator().manual_seed(PS)
    topk, Hi, Di = 32, 4, 16
    lens = [5, 100, 32, 0, 77, 1]
    _, (k_cache,), bt, sl, _ = ref.build_paged(lens, PS, (Di,), torch.float32, generator=g, shuffle=True)
    q = torch.randn(len(lens), Hi, Di, generator=g)
    weights = torch.randn(len(lens), Hi, generator=g)
    short = torch.tensor([n <= topk for n in lens])
    # Poison the short rows' queries: if their logits were computed, NaN scores would reorder them.
    q[short] = float("nan")
    args = [t.to(device) for t in (q, weights, k_cache, bt, sl)]
    got = torch.ops.dsa.indexer_topk(*args, topk, Di ** -0.5).cpu()
    for b, n in enumerate(lens):
        if n <= topk:
            assert got[b].tolist() == ref.request_slots(bt, PS, b, n) + [-1] * (topk - n)
        else:  # long rows: the true top-k by score
            by_slot, top = ref.ref_topk_scores(q, weights, k_cache, bt, sl, Di ** -0.5, topk, b)
            picked = sorted((by_slot[s] for s in got[b].tolist()), reverse=True)
            assert torch.allclose(torch.tensor(picked), torch.tensor(top), rtol=1e-5, atol=1e-5)
