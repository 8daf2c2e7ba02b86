import os

import pytest
import torch
from hypothesis import HealthCheck, settings

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
