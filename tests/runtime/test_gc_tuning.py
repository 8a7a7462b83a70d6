"""The garbage-collector controls of the server processes (lmprog_runtime/gc_tuning.py)."""

import gc
import logging

import pytest

from lmprog_runtime import gc_tuning
from lmprog_runtime.config import ServerArgs


def _cycles(n: int = 2000) -> None:
    for _ in range(n):
        a = []
        a.append(a)


def test_monitor_counts_times_and_warns(caplog):
    mon = gc_tuning.GcMonitor(warn_s=1e-9).install()
    try:
        _cycles()
        with caplog.at_level(logging.WARNING, logger="lmprog_runtime.gc_tuning"):
            gc.collect()
        assert mon.counts[2] >= 1 and mon.max_s[2] > 0 and mon.total_s[2] >= mon.max_s[2]
        assert any("generation-2 garbage collection took" in r.getMessage() for r in caplog.records)
        stats = mon.stats()
        assert stats["gc_collections"][2] == mon.counts[2] and len(stats["gc_pause_s_max"]) == 3
    finally:
        mon.uninstall()
    before = list(mon.counts)
    gc.collect()
    assert mon.counts == before  # uninstalled: no longer called


def test_monitor_is_quiet_without_a_threshold(caplog):
    mon = gc_tuning.GcMonitor(warn_s=0.0).install()
    try:
        with caplog.at_level(logging.WARNING, logger="lmprog_runtime.gc_tuning"):
            gc.collect()
        assert mon.counts[2] >= 1 and not caplog.records
    finally:
        mon.uninstall()


def test_freeze_moves_live_objects_out_of_collections():
    try:
        frozen = gc_tuning.freeze()
        # (other threads' frozen objects freed by reference counting leave the count meanwhile)
        assert frozen > 1000 and gc.get_freeze_count() > 0.9 * frozen
        assert len(gc.get_objects(generation=2)) < frozen  # the old generation no longer holds them
    finally:
        gc.unfreeze()


def test_engine_reports_and_freezes(tiny_engine):
    state = tiny_engine.get_internal_state()
    assert len(state["gc_collections"]) == 3 and "gc_frozen_objects" in state
    try:
        reply = tiny_engine.freeze_gc()
        assert reply["success"] and reply["gc_frozen_objects"] > 1000
        # (frozen objects freed by reference counting leave the count: it may shrink a little)
        assert tiny_engine.get_internal_state()["gc_frozen_objects"] > 0.9 * reply["gc_frozen_objects"]
    finally:
        gc.unfreeze()


def test_threshold_must_not_be_negative():
    with pytest.raises(ValueError, match="gc_warning_threshold_secs must be >= 0"):
        ServerArgs(gc_warning_threshold_secs=-1)
