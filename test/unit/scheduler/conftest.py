"""Every scheduler test runs with the overlap loop on and off (semantics §7: same outputs)."""
import pytest

from test.support import scheduler_harness as harness


@pytest.fixture(autouse=True, params=["overlap", "normal"])
def schedule_mode(request):
    harness.DEFAULT_OVERLAP = request.param == "overlap"
    yield request.param
    harness.DEFAULT_OVERLAP = True
