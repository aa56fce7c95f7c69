"""The periodic step lines at info level (SGLang's wording): one per prefill batch, one every
--decode-log-interval decode steps, with numbers that match what the scheduler did."""
from __future__ import annotations

import logging
import re

import pytest

from radixlm.config import ServerArgs

from test.support.scheduler_harness import make_harness

PREFILL = re.compile(r"^Prefill batch\. #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+), "
                     r"token usage: (\d+\.\d\d), #running-req: (\d+), #queue-req: (\d+)$")
DECODE = re.compile(r"^Decode batch\. #running-req: (\d+), #token: (\d+), token usage: (\d+\.\d\d), "
                    r"gen throughput \(token/s\): (\d+\.\d\d), #queue-req: (\d+)$")
LOGGER = "radixlm.scheduler.step_log"


def _lines(caplog, pattern: re.Pattern[str]) -> list[tuple[float, ...]]:
    out = []
    for rec in caplog.records:
        if rec.name == LOGGER and rec.levelno == logging.INFO:
            m = pattern.match(rec.getMessage())
            if m:
                out.append(tuple(float(g) for g in m.groups()))
    return out


def test_prefill_and_decode_lines_report_the_batches(caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    h = make_harness(capacity=1024, decode_log_interval=5)
    prompts = [[(31 * i + j) % 97 for j in range(20 + i)] for i in range(3)]  # no prefix in common
    for p in prompts:
        h.submit(p, max_new_tokens=21)
    h.run()
    (prefill,) = _lines(caplog, PREFILL)  # one batch takes all three: nothing cached yet, nothing left
    assert prefill[:3] == (3, 20 + 21 + 22, 0) and prefill[4:] == (0, 0) and 0 < prefill[3] <= 1
    decodes = _lines(caplog, DECODE)
    # 20 decode steps (the first token comes from the prefill): one line each 5 steps
    assert len(decodes) == 4, decodes
    assert all(d[0] == 3 and 0 < d[1] <= 1024 and 0 < d[2] <= 1 and d[3] > 0 for d in decodes)
    # a second run of the same prompts is served from the tree: its prefill line says so
    caplog.clear()
    h.submit(prompts[0], max_new_tokens=2)
    h.run()
    (line,) = _lines(caplog, PREFILL)
    assert line[:3] == (1, 1, 19)  # the last prompt token is always computed
    h.assert_idle_and_conserved()


def test_no_lines_below_info(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    h = make_harness(decode_log_interval=1)
    h.submit(list(range(1, 10)), max_new_tokens=4)
    h.run()
    assert not [r for r in caplog.records if r.name == LOGGER]


def test_decode_log_interval_must_be_positive():
    with pytest.raises(ValueError, match="decode_log_interval must be >= 1"):
        ServerArgs(decode_log_interval=0).verify()
