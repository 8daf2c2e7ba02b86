import os
import sys

import pytest
import torch
import torch._inductor.config
from hypothesis import HealthCheck, settings

from tree import import_roots  # tests/ is on sys.path: pytest imports this conftest from there

for _d in reversed(import_roots()):  # helpers and the test modules others import, by name (tests/tree.py)
    if _d not in sys.path:
        sys.path.insert(0, _d)

# Threads per test process: the cores shared among the processes running tests at once (pytest-xdist's workers:
# README's command runs one per core, up to 4). On small machines (CI: 2 cores) that is one intra-op thread and
# one Inductor compile thread per process, children included (the demo's ranks, gloo spawns, interpreter
# children): the cores are shared by pytest, its spawned ranks and the C++ compiler; the tests' tensors are small,
# and with 2 threads on busy cores a tiny bmm took 8.6 ms against 1.9 us on 1. An explicit OMP_NUM_THREADS /
# TORCHINDUCTOR_COMPILE_THREADS wins; one process on the GPU machine (16 cores) keeps the defaults.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
_cores = os.cpu_count() or 1
if _cores <= 4 or _workers > 1:
    _share = str(max(1, _cores // _workers) if _cores > 4 else 1)
    os.environ.setdefault("OMP_NUM_THREADS", _share)
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", _share)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch._inductor.config.compile_threads = int(os.environ["TORCHINDUCTOR_COMPILE_THREADS"])

# "ci": a few hundred examples per op; "slow": >= 2,000 (run with HYPOTHESIS_PROFILE=slow pytest -m slow)
settings.register_profile("ci", max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("slow", max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def fresh_dynamo():
    """A clean Dynamo cache and clean `counters` around a test (compile-counting tests opt in with
    `pytestmark = pytest.mark.usefixtures("fresh_dynamo")`)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    yield
    torch._dynamo.reset()
