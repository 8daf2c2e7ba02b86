"""DSA dual graphs under CUDA-graph trees (mode="reduce-overhead") on the GPU.

Each variant (dense k-only, sparse indexer) must be recorded exactly once per batch size, with no
cudagraph skips and no re-recording over 200+ steps, and results must match eager.
"""

import copy
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from dsa_decode import DecodeState, DSADecodeLayer  # noqa: E402

from mla_compile.dsa import mark_max_kv_len_dynamic  # noqa: E402

TOPK = 64


@pytest.mark.parametrize("batch", [4, 8])
def test_each_variant_recorded_once(batch, cudagraph_recordings):
    from torch._dynamo.utils import counters

    recordings = cudagraph_recordings

    torch.manual_seed(0)
    layer = DSADecodeLayer(topk=TOPK).cuda().eval()
    reference = copy.deepcopy(layer)
    start = [3, 10, 40, 1, 7, 20, 33, 2][:batch]
    state = DecodeState(layer, start, max_len=max(start) + 260)
    ref_state = copy.deepcopy(state)
    for s in (state, ref_state):
        for name in ("block_table", "ckv", "kpe", "index"):
            setattr(s, name, getattr(s, name).cuda())
    for name in ("ckv", "kpe", "index"):
        torch._dynamo.mark_static_address(getattr(state, name))  # mutated inside the graphs
    mark_max_kv_len_dynamic()
    compiled = torch.compile(layer, backend="mla_dcp", mode="reduce-overhead", fullgraph=True)
    crossed = False
    with torch.no_grad():
        for step in range(230):
            if step == 40:
                torch.compiler.set_stance("fail_on_recompile")
            seq_lens, slots, max_kv_len = state.step_inputs()
            ref_lens, ref_slots, _ = ref_state.step_inputs()
            crossed |= max_kv_len > TOPK
            x = torch.randn(batch, 256, device="cuda")
            out = compiled(x, state.ckv, state.kpe, state.index, state.block_table, seq_lens.cuda(), slots.cuda(),
                           max_kv_len)
            ref = reference(x, ref_state.ckv, ref_state.kpe, ref_state.index, ref_state.block_table,
                            ref_lens.cuda(), ref_slots.cuda(), max_kv_len)
            torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
    torch.compiler.set_stance("default")
    assert crossed
    assert counters["stats"]["unique_graphs"] == 2
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert len(recordings) == 2, f"expected one recording per variant, got {len(recordings)}"
    assert len(set(recordings)) == 2
