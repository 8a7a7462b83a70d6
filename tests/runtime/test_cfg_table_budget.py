"""The process-wide bound on mask tables (constrained/cfg/table_budget.py): a table's bytes
come back when it is collected, from its finalizer, which the garbage collector may run on
any thread at any allocation, including one inside the budget's own critical section."""
import gc
import threading
import time
import weakref

from lmprog_runtime.constrained.cfg import table
from lmprog_runtime.constrained.cfg.table_budget import TableBudget


class _Table:
    """Stands in for a StateTable: tracked, its bytes given back by the same finalizer."""

    def __init__(self, budget: TableBudget, nbytes: int):
        self.lock = threading.Lock()
        self._held = [nbytes]
        weakref.finalize(self, table._give_back, self._held, budget)
        budget.track(self)
        budget.resize(nbytes)

    def reset(self) -> None:
        pass


def _in_thread(fn, timeout: float = 10.0) -> bool:
    """fn() finished on another thread within `timeout` (False: it is stuck)."""
    done = threading.Event()

    def run():
        fn()
        done.set()
    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout)


def test_a_table_collected_inside_the_budgets_critical_section_does_not_deadlock():
    budget = TableBudget(total=1 << 20, low=1 << 19)
    gc.disable()  # (the cycle is collected inside the lock below, not by an automatic collection before)
    try:
        gone = _Table(budget, 4096)
        cycle = [gone]
        cycle.append(cycle)  # (only the cycle collector frees it: at some allocation, not at `del`)
        del gone, cycle

        def collect_while_locked():
            with budget._lock:  # (what track / resize / before_walk hold while they allocate)
                gc.collect()
        assert _in_thread(collect_while_locked), \
            "the table's finalizer waited on the budget's lock its own thread held"
    finally:
        gc.enable()
    kept = _Table(budget, 1000)
    budget.before_walk(kept)  # (the given-back bytes are counted before the budget is read)
    assert budget.used == 1000


def test_collected_tables_bytes_are_counted_before_an_eviction_reads_the_total():
    budget = TableBudget(total=10_000, low=5_000)
    kept = _Table(budget, 4000)
    loose = [_Table(budget, 3000) for _ in range(3)]
    del loose
    gc.collect()
    assert budget._returned  # (given back by their finalizers, not counted yet)
    budget.before_walk(kept)  # 13,000 tracked, 4,000 live: under the total, nothing emptied
    assert budget.used == 4000 and not budget._returned


class _SlowTable(_Table):
    """A table whose emptying takes `seconds` and gives its bytes back (StateTable.reset's
    account does)."""

    def __init__(self, budget: TableBudget, nbytes: int, seconds: float):
        super().__init__(budget, nbytes)
        self.budget, self.seconds, self.resets = budget, seconds, 0

    def reset(self) -> None:
        time.sleep(self.seconds)
        self.resets += 1
        self.budget.resize(-self._held[0])
        self._held[0] = 0


def test_one_walk_empties_tables_for_a_bounded_time_and_the_next_walks_go_on():
    """Emptying runs where a mask is needed (the scheduler's thread): one walk spends at
    most evict_s on it, then the next walks go on until the total is down to `low`."""
    budget = TableBudget(total=10_000, low=2_000, evict_s=0.01)
    tables = [_SlowTable(budget, 1000, 0.004) for _ in range(12)]  # 12,000: past the total
    walker = tables[-1]
    t0 = time.perf_counter()
    budget.before_walk(walker)
    took = time.perf_counter() - t0
    emptied = sum(t.resets for t in tables)
    assert 1 <= emptied <= 6 and took < 0.1, (emptied, took)  # (not all ten it takes at once)
    assert tables[0].resets == 1  # (the least recently walked first)
    for _ in range(20):
        if budget.used <= budget.low:
            break
        budget.before_walk(walker)  # (under the total now, yet it goes on down to low)
    assert budget.used <= budget.low and walker.resets == 0
    before = sum(t.resets for t in tables)
    budget.before_walk(walker)  # (done: under the total, nothing more emptied)
    assert sum(t.resets for t in tables) == before
