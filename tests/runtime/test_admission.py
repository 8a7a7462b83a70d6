"""The admission part on its own (a real KVManager, no model): limits, clamping, chunk
and prefill budgets, reserved decode room, retraction with page_size > 1."""

import pytest

from lmprog_runtime.config import ServerArgs
from lmprog_runtime.scheduler.admission import Admission
from lmprog_runtime.scheduler.limits import DECODE_LIKE_EXTEND, INPUT_HEADROOM, AdmissionLimits
from lmprog_runtime.scheduler.policy import SchedulePolicy
from test_kv_manager import make_kv, make_req


def make_admission(page_size=1, pool_tokens=256, rows=4, **flags):
    args = ServerArgs(page_size=page_size, **flags)
    kv = make_kv(page_size, pool_tokens=pool_tokens, rows=rows)
    limits = AdmissionLimits.derive(args, pool_tokens, rows, context_len=2048)
    return Admission(limits, kv, SchedulePolicy(args.schedule_policy, kv.cache_enabled))


def run_step(adm, running, waiting):
    """Admit, then do what the scheduler and the post-processor do with the decision."""
    d = adm.admit(running, waiting)
    for r in d.retracted:
        running.remove(r)
        waiting.insert(0, r)
    for r in d.admitted:
        waiting.remove(r)
        running.append(r)
    for item in d.plan.items:
        adm.kv.commit(item.req, item.num_tokens)
    return d


def decode_all(adm, running):
    for r in running:
        if r.kv_len == r.seq_len:
            r.output_ids.append(7)


def test_limits_are_derived_once_from_the_flags():
    lim = AdmissionLimits.derive(ServerArgs(chunked_prefill_size=64, page_size=16),
                                 pool_tokens=4096, pool_rows=8, context_len=1000)
    assert lim.context_len == 1000 and lim.max_req_len == 999
    assert lim.max_req_input_len == 999 - INPUT_HEADROOM
    assert lim.max_running == 8  # the pool's rows
    assert lim.chunk_tokens == 64 and lim.page_size == 16
    lim = AdmissionLimits.derive(ServerArgs(), pool_tokens=300, pool_rows=8, context_len=2048)
    assert lim.max_req_len == 299 and lim.chunk_tokens == 512


def test_check_rejects_and_clamps():
    adm = make_admission(pool_tokens=256)
    assert adm.check(make_req([])).status_code == 400
    long = adm.check(make_req(list(range(300))))
    assert long.is_error and "exceeds the maximum allowed length" in long.message
    r = make_req(list(range(100)), max_new_tokens=1000)
    r.min_new_tokens = 900
    assert adm.check(r) is None
    # the pool: 256 - 100 (prompt) - 1 (a spare page of 1) - 1; the context: 255 - 100 - 1
    assert r.max_new_tokens == min(256 - 100 - 1 - 1, 255 - 100 - 1) and r.min_new_tokens == r.max_new_tokens
    assert r.sampling.max_new_tokens == 1000  # the message's own params are never touched


def test_check_rounds_the_prompt_up_to_pages():
    adm = make_admission(page_size=16, pool_tokens=256)
    r = make_req(list(range(100)), max_new_tokens=1000)
    adm.check(r)
    assert r.max_new_tokens == 256 - 112 - 16 - 1


def test_long_prompt_is_chunked_by_the_chunk_budget():
    adm = make_admission(pool_tokens=512, chunked_prefill_size=64)
    a = make_req(list(range(150)), max_new_tokens=4)
    running, waiting = [], [a]
    sizes = []
    while a.kv_len < a.prompt_len:
        d = run_step(adm, running, waiting)
        sizes.append([it.num_tokens for it in d.plan.items])
    assert sizes == [[64], [64], [22]]
    adm.kv.check_integrity(running)


def test_decodes_are_not_charged_to_the_chunk_budget():
    adm = make_admission(pool_tokens=1024, chunked_prefill_size=64)
    running, waiting = [], [make_req(list(range(10)), rid="a")]
    run_step(adm, running, waiting)
    decode_all(adm, running)
    waiting.append(make_req(list(range(200, 400)), rid="b"))
    d = run_step(adm, running, waiting)
    assert [(it.req.rid, it.num_tokens) for it in d.plan.items] == [("a", 1), ("b", 64)]


def test_max_running_and_prefill_budget():
    adm = make_admission(pool_tokens=1024, rows=2)
    waiting = [make_req(list(range(i * 50, i * 50 + 20)), rid=str(i)) for i in range(3)]
    running = []
    d = run_step(adm, running, waiting)
    assert [r.rid for r in d.admitted] == ["0", "1"]  # two rows
    adm = make_admission(pool_tokens=1024, max_prefill_tokens=30)
    waiting = [make_req(list(range(i * 50, i * 50 + 20)), rid=str(i)) for i in range(3)]
    d = run_step(adm, [], waiting)
    assert [r.rid for r in d.admitted] == ["0", "1"]  # 20 + 20 > 30: the budget ran out after two


def test_reserved_decode_room_holds_back_new_requests():
    adm = make_admission(pool_tokens=256)
    a = make_req(list(range(20)), rid="a", max_new_tokens=200)
    b = make_req(list(range(100, 120)), rid="b", max_new_tokens=200)
    running, waiting = [], [a, b]
    d = run_step(adm, running, waiting)
    # a (first, always taken) reserves 200 * 0.7 = 140 of the 236 left: b's 20 + 140 do not fit
    assert [r.rid for r in d.admitted] == ["a"] and waiting == [b]
    assert b.row is None  # its row and prefix lock were given back
    adm.kv.check_integrity(running)


@pytest.mark.parametrize("p", [1, 16])
def test_decode_retracts_when_the_pool_runs_short(p):
    adm = make_admission(page_size=p, pool_tokens=128, rows=4)
    reqs = [make_req(list(range(i * 100, i * 100 + 30)), rid=str(i), max_new_tokens=90) for i in range(3)]
    for r in reqs:
        adm.check(r)
    running, waiting = [], list(reqs)
    adm.new_token_ratio = adm.min_ratio = 0.0  # admit all three at once
    run_step(adm, running, waiting)
    assert len(running) == 3
    retracted = []
    for _ in range(80):
        decode_all(adm, running)
        d = run_step(adm, running, waiting)
        retracted += d.retracted
        assert all(it.num_tokens <= DECODE_LIKE_EXTEND or it.req in d.admitted for it in d.plan.items)
        adm.kv.check_integrity(running)
        if retracted:
            break
    assert retracted, "the pool never ran short"
    victim = retracted[0]
    assert victim.num_retractions == 1 and victim.row is None and victim.kv_len == 0
    assert waiting[0] is victim  # back at the front of the queue
    assert adm.new_token_ratio > 0.0  # raised after the retraction
    assert not any(r.finished for r in running)


def test_single_request_that_cannot_fit_is_failed():
    adm = make_admission(page_size=16, pool_tokens=64, rows=2)
    a = make_req(list(range(40)), max_new_tokens=500)  # unclamped on purpose
    running, waiting = [], [a]
    run_step(adm, running, waiting)
    for _ in range(40):
        decode_all(adm, running)
        run_step(adm, running, waiting)
        if a.finished:
            break
    assert a.finished_reason.is_error and a.finished_reason.status_code == 500


def test_watchdog_logs_a_stuck_step_with_its_stack(caplog):
    import time

    from lmprog_runtime.scheduler.watchdog import Watchdog

    dog = Watchdog(0.1)
    dog.start()
    try:
        dog.step_begin()
        time.sleep(0.6)  # "stuck" here
        dog.step_end()
        dog.step_begin()
        dog.step_end()  # a quick step does not trip
        time.sleep(0.3)
    finally:
        dog.stop()
    stuck = [r for r in caplog.records if "watchdog" in r.getMessage()]
    assert dog.trips == 1 and len(stuck) == 1
    assert "test_watchdog_logs_a_stuck_step_with_its_stack" in stuck[0].getMessage()  # the stack
