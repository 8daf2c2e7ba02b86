"""DSA dual graphs on the plain-PyTorch example: exactly two graphs, guarded on max_kv_len vs topk."""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mla_compile.backend import mla_dcp
from mla_compile.dsa import mark_max_kv_len_dynamic

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from dsa_decode import DecodeState, DSADecodeLayer  # noqa: E402

TOPK = 64


class RecordingBackend:
    """mla_dcp, keeping each Dynamo graph it was given."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return mla_dcp(gm, example_inputs)


def op_targets(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_two_graphs_across_topk_and_no_recompiles():
    torch.manual_seed(0)
    layer = DSADecodeLayer(topk=TOPK).eval()
    reference = copy.deepcopy(layer)
    mark_max_kv_len_dynamic()
    backend = RecordingBackend()
    compiled = torch.compile(layer, backend=backend, fullgraph=True)
    start = [3, 10, 40, 1]
    state = DecodeState(layer, start, max_len=max(start) + 260)
    ref_state = copy.deepcopy(state)
    maxes = []
    with torch.no_grad():
        for step in range(230):
            if step == 30:  # both variants seen by now (40 + 30 > 64): no more compiles allowed
                assert len(backend.graphs) == 2
                torch.compiler.set_stance("fail_on_recompile")
            seq_lens, slots, max_kv_len = state.step_inputs()
            ref_lens, ref_slots, _ = ref_state.step_inputs()
            x = torch.randn(len(start), 256)
            out = compiled(x, state.ckv, state.kpe, state.index, state.block_table, seq_lens, slots, max_kv_len)
            ref = reference(x, ref_state.ckv, ref_state.kpe, ref_state.index, ref_state.block_table, ref_lens,
                            ref_slots, max_kv_len)
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            maxes.append(max_kv_len)
    torch.compiler.set_stance("default")
    assert min(maxes) <= TOPK < max(maxes)
    assert len(backend.graphs) == 2
    dense, sparse = (op_targets(g) for g in backend.graphs)
    assert "dsa.k_only_indices" in dense and "dsa.indexer_topk" not in dense
    assert "dsa.indexer_topk" in sparse and "dsa.k_only_indices" not in sparse
    # the int never reaches the graph as an input (CUDA-graph trees would re-record per value)
    for g in backend.graphs:
        placeholders = [n for n in g.graph.nodes if n.op == "placeholder"]
        assert not any(isinstance(n.meta.get("example_value"), torch.SymInt) for n in placeholders)


def test_guards_name_the_topk_comparison():
    code = (
        "import sys; sys.path.insert(0, 'examples');"
        "import dsa_decode; dsa_decode.run(steps=40, start_lens=(50, 3), topk=64)"
    )
    env = {**os.environ, "TORCH_LOGS": "guards"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "L['max_kv_len'] <= 64" in proc.stderr
    assert "65 <= L['max_kv_len']" in proc.stderr
