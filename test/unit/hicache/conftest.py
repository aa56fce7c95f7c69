"""Scheduler-level HiCache tests run with the overlap loop on and off (semantics §7)."""
import pytest

from test.support import hicache_harness as harness


@pytest.fixture(params=["overlap", "normal"])
def schedule_mode(request):
    harness.DEFAULT_OVERLAP = request.param == "overlap"
    yield request.param
    harness.DEFAULT_OVERLAP = True
