"""What the CPU stand-ins for `flash_mla` share (tests/kernels/test_flashmla_fallback.py: its dense decode;
tests/kernels/test_flashmla_fp8_fallback.py: its sparse FP8 decode): the calls they saw, and FlashMLA's schedule
object, empty when made and filled by the call it is handed to (one reused across calls would be stale)."""

from __future__ import annotations


class SchedMeta:
    """An empty schedule: FlashMLA fills it during the call when it arrives empty."""

    filled = False


class StandIn:
    def __init__(self):
        self.calls = []

    @staticmethod
    def get_mla_metadata(*args, **kwargs):
        return SchedMeta(), None

    @staticmethod
    def fill(schedule: SchedMeta) -> None:
        assert not schedule.filled, "a schedule reused across calls would be stale"
        schedule.filled = True
