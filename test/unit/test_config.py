"""ServerArgs: command-line choices come from the registries, and each component gets its part."""
from __future__ import annotations

import argparse

import pytest

from radixlm.config import ServerArgs


def _parse(*argv: str) -> ServerArgs:
    p = argparse.ArgumentParser()
    ServerArgs.add_cli_args(p)
    return ServerArgs.from_cli_args(p.parse_args(list(argv)))


def test_every_registered_implementation_is_a_choice():
    from radixlm.hicache.host_tier import WRITE_POLICIES
    from radixlm.radix_cache.eviction import EVICTION_POLICIES
    from radixlm.scheduler.policy import SCHEDULE_POLICIES
    from radixlm.scheduler.retract import RETRACTION_POLICIES
    from radixlm.srt.model_runner.attention.base import ATTENTION_BACKENDS

    assert {"mru", "filo", "slru"} <= set(EVICTION_POLICIES.names())  # once not on the command line
    for flag, names in (("--radix-eviction-policy", EVICTION_POLICIES.names()),
                        ("--schedule-policy", SCHEDULE_POLICIES.names()),
                        ("--retraction-policy", RETRACTION_POLICIES.names()),
                        ("--hicache-write-policy", WRITE_POLICIES),
                        ("--attention-backend", ["auto", *ATTENTION_BACKENDS.names()])):
        for name in names:
            args = _parse(flag, name)
            assert getattr(args, flag[2:].replace("-", "_")) == name
        with pytest.raises(SystemExit):
            _parse(flag, "no-such-thing")
    with pytest.raises(ValueError, match="radix_eviction_policy"):
        ServerArgs.from_kwargs(radix_eviction_policy="no-such-thing")


def test_components_get_their_own_config():
    args = ServerArgs.from_kwargs(radix_eviction_policy="slru", page_size=4, schedule_policy="lpm",
                                  enable_hierarchical_cache=True, hicache_ratio=3.0, request_running_timeout=2.0)
    cache = args.prefix_cache_config()
    assert (cache.kind, cache.eviction_policy, cache.page_size, cache.hicache_ratio) == ("hiradix", "slru", 4, 3.0)
    assert ServerArgs().prefix_cache_config().kind == "radix"
    assert ServerArgs(disable_radix_cache=True).prefix_cache_config().kind == "none"
    sched = args.scheduler_config(max_running_requests=7, chunked_prefill_size=None, device="cpu")
    assert (sched.max_running_requests, sched.schedule_policy, sched.page_size) == (7, "lpm", 4)
    assert sched.request_running_timeout == 2.0 and sched.overlap is False
    assert args.scheduler_config(max_running_requests=1, chunked_prefill_size=8, device="cuda").overlap is True


@pytest.mark.parametrize("nice", [-1, 20])
def test_scheduler_nice_is_a_niceness(nice):
    with pytest.raises(ValueError, match="scheduler_nice"):
        ServerArgs.from_kwargs(scheduler_nice=nice)
    assert ServerArgs.from_kwargs(scheduler_nice=0).scheduler_nice == 0


def test_scheduler_policy_is_normal_idle_or_fifo():
    assert ServerArgs().scheduler_policy == "normal"
    assert ServerArgs.from_kwargs(scheduler_policy="idle").scheduler_policy == "idle"
    assert ServerArgs.from_kwargs(scheduler_policy="fifo").scheduler_policy == "fifo"
    with pytest.raises(ValueError, match="scheduler_policy"):
        ServerArgs.from_kwargs(scheduler_policy="realtime")
