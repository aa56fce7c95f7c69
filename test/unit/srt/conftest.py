"""Fixtures of the model-level tests; the driver itself is test/support/model_harness.py."""
from __future__ import annotations

import pytest

from test.support.model_harness import ModelHarness


@pytest.fixture
def make_harness():
    return ModelHarness
