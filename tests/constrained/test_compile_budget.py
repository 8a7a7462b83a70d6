"""The grammar compile budget: spec size, unrolled size, and a DFA build in a worker
process that is stopped past the memory cap and killed past the time limit."""

import os
import time

import pytest

from lmprog_runtime.constrained.dfa_build import BudgetExceeded, IsolatedBuilder, build_tables

# (a|b)*a(a|b){k}: k + 2 regex positions, but 2^(k+1) DFA states, so no size estimate sees it
EXPONENTIAL = "(a|b)*a(a|b){%d}"


@pytest.fixture
def builder():
    b = IsolatedBuilder()
    yield b
    b.close()


def test_worker_builds_the_same_tables(builder):
    for regex in ("[a-z]{1,5}", '\\{"a":(true|false)\\}', "(ab|cd)*x?"):
        mine, theirs = build_tables(regex), builder.build(regex, 30, 4096)
        assert mine["n_states"] == theirs["n_states"] and mine["finals"] == theirs["finals"]
        assert (mine["trans"] == theirs["trans"]).all() and (mine["byte_class"] == theirs["byte_class"]).all()


def test_memory_cap_stops_the_build(builder):
    t0 = time.monotonic()
    with pytest.raises(BudgetExceeded, match="LMPROG_GRAMMAR_COMPILE_MEMORY_MB"):
        builder.build(EXPONENTIAL % 18, 120, 200)
    assert time.monotonic() - t0 < 120
    assert builder.build("abc", 30, 4096)["n_states"] == build_tables("abc")["n_states"]  # a fresh worker


def test_time_limit_kills_the_build(builder):
    t0 = time.monotonic()
    with pytest.raises(BudgetExceeded, match="LMPROG_GRAMMAR_COMPILE_TIMEOUT"):
        builder.build(EXPONENTIAL % 24, 1.0, 8192)
    assert time.monotonic() - t0 < 10
    pid = builder._local.worker.proc.pid
    assert builder._local.worker.proc.poll() is not None  # killed, not left running
    assert builder.build("x", 30, 4096)["n_states"] == build_tables("x")["n_states"] and builder._local.worker.proc.pid != pid


def test_compile_errors_come_back(builder):
    with pytest.raises(ValueError, match="NFA"):
        builder.build("(", 30, 4096)


def test_close_ends_the_workers(builder):
    builder.build("x", 30, 4096)
    proc = builder._local.worker.proc
    builder.close()
    assert proc.poll() is not None
    assert not os.path.exists(f"/proc/{proc.pid}/status") or "Z" in open(f"/proc/{proc.pid}/status").read()
