import os
import sys

# tests/reference.py (the float64 references) lives one level up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402


@pytest.fixture
def cudagraph_recordings(monkeypatch):
    """A fresh Dynamo + counters, and the list of CUDA-graph-tree recordings (one function id per recording)."""
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import cudagraph_trees

    torch._dynamo.reset()
    counters.clear()
    recordings = []
    original = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counting(self, new_inputs, function_id):
        recordings.append(function_id)
        return original(self, new_inputs, function_id)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counting)
    return recordings
