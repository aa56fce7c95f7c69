"""gc_watch: collections are counted and timed per generation, long ones warned about, and
freezing moves the live heap out of the collector's reach."""
from __future__ import annotations

import gc
import logging

from radixlm.srt.gc_watch import GCWatch, freeze_startup_heap


def test_collections_are_counted_and_timed_per_generation():
    watch = GCWatch().install()
    try:
        gc.collect(0)
        gc.collect()
        stats = watch.stats()
    finally:
        watch.uninstall()
    assert stats["collections"][0] >= 1 and stats["collections"][2] >= 1
    assert stats["pause_max_s"][2] > 0 and stats["pause_total_s"][2] >= stats["pause_max_s"][2]
    assert watch._on_gc not in gc.callbacks
    before = list(watch.counts)
    gc.collect()
    assert watch.counts == before  # uninstalled: no longer counting


def test_a_pause_over_the_threshold_is_a_warning(caplog):
    watch = GCWatch(warn_threshold_s=1e-9).install()
    try:
        with caplog.at_level(logging.WARNING, logger="radixlm.srt.gc_watch"):
            gc.collect()
    finally:
        watch.uninstall()
    assert any("generation-2 garbage collection took" in r.getMessage() for r in caplog.records)
    quiet = GCWatch().install()  # threshold 0: never
    try:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="radixlm.srt.gc_watch"):
            gc.collect()
    finally:
        quiet.uninstall()
    assert not caplog.records


def test_freeze_moves_the_live_heap_to_the_permanent_generation():
    kept = [[i] for i in range(1000)]  # noqa: F841 - alive across the freeze
    try:
        frozen = freeze_startup_heap()
        assert frozen >= 1000
        tracked = len(gc.get_objects())
        assert tracked < frozen  # the frozen objects are no longer walked by a collection
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
