"""The scheduler: owns the model runner, the KV pool, the radix cache and the grammars,
and runs the batch loop. One step:

    admit → build batch → forward → sample + post-process → release finished → send

Every step, each running request contributes the tokens it has not computed yet
(`fill_ids[kv_len:]`): one after a normal decode step, several while its prompt is
being prefilled in chunks, plus any draft it verifies (speculative tokens, or the text
its grammar forces: jump-forward). So continuous batching, chunked prefill and
jump-forward all fall out of one mechanism.

Parts and their contracts (each gets its collaborators explicitly):
    Admission      (admission.py)   running + waiting → Admitted(plan, admitted, retracted)
    build_forward_batch (batch.py)  StepPlan → ForwardBatch (which logits rows to keep)
    runner.forward                  ForwardBatch → logits [rows, vocab]
    MaskBuilder    (grammar_mask.py) sampled requests → allowed-token mask or None
    PostProcessor  (output.py)      plan + logits + mask → tokens appended, stops set,
                                    streamed deltas queued in the Outbox
    KVManager      (cache/manager.py) every KV ownership move
    Outbox         (outbox.py)      deltas for the tokenizer manager, sent once per step
    JumpForward    (jump_forward.py) running → drafts of the text grammars force (before
                                    admission; exact: verified like speculative drafts)
    Speculator     (speculative/)   running → drafts (before admission); the verify step
                                    in PostProcessor accepts a prefix + a bonus token
    disagg         (disaggregation/) prefill/decode roles: queue stages before `waiting`
                                    (prefill) or before `running` (decode), polled before
                                    admission; ships KV pages after each step (prefill)
Two loops share these parts: `step` (plain) and `step_overlapped`, where the forward runs
on a worker thread while this one sends, takes in messages and builds the masks. With
speculative decoding the plain loop runs (drafts need the previous step's tokens).

Fault isolation (faults.py): an exception while handling one request — on arrival, in
admission, sampling, `on_token`, building or sending its output — finishes that request
with an error 500 naming the stage; a failed forward fails the requests of its batch.
The loop goes on. An exception in the loop's own bookkeeping still ends `run_forever`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, List, Optional

from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.manager import KVManager
from lmprog_runtime.cache.storage_control import StorageControl
from lmprog_runtime.config import GRAMMAR_COMPILE_TIMEOUT_S, ServerArgs
from lmprog_runtime.disaggregation import build_stages, refusal
from lmprog_runtime.messages import (AbortReq, BatchOutput, ControlReply, EmbedReq, FinishReason,
                                     TokenizedGenerateReq)
from lmprog_runtime.model_executor.sampler import Sampler
from lmprog_runtime.scheduler.admission import Admission, AdmissionLimits
from lmprog_runtime.scheduler.batch import StepPlan, build_forward_batch
from lmprog_runtime.scheduler.faults import Stage, error_reason, fail_request
from lmprog_runtime.scheduler.grammar_mask import MaskBuilder
from lmprog_runtime.scheduler.grammars import GrammarQueue
from lmprog_runtime.scheduler.control import check_integrity, control_reply, flush_cache, internal_state
from lmprog_runtime.scheduler.inspect import StepRing
from lmprog_runtime.scheduler.limits import DECODE_LIKE_EXTEND
from lmprog_runtime.scheduler.outbox import Outbox, error_output
from lmprog_runtime.scheduler.jump_forward import JumpForward, forced_drafts
from lmprog_runtime.scheduler.output import PostProcessor
from lmprog_runtime.scheduler.policy import SchedulePolicy
from lmprog_runtime.scheduler.request import Req, SpecCounts
from lmprog_runtime.scheduler.stops import StopChecker
from lmprog_runtime.scheduler.watchdog import Watchdog
from lmprog_runtime.scheduler.weights import WeightControl
from lmprog_runtime.speculative.speculator import build_speculator

logger = logging.getLogger(__name__)

STATS_EVERY_STEPS = 8  # scheduler gauges ride along with every 8th batch of outputs
PREFETCH_POLL_S = 0.005  # seconds an idle step waits for a storage prefetch to finish
GRAMMAR_POLL_S = 0.002  # seconds an idle step waits for a grammar compile (new messages wait this long)


def _new_stats() -> dict:
    """Counters for /metrics and server info (token counts; seconds of wall time)."""
    return {"num_prompt_tokens": 0, "num_cached_tokens": 0, "num_generated_tokens": 0,
            "num_retractions": 0, "num_steps": 0, "forward_s": 0.0, "step_s": 0.0,
            "mask_s": 0.0, "mask_rows": 0, "num_jump_forward_tokens": 0, "num_jump_forward_drafted": 0}


class Scheduler:
    def __init__(self, server_args: ServerArgs, runner, tree=None, grammar_factory=None, faults=None):
        """`faults`: a `faults.FaultInjector`, for tests only (no flag reaches it)."""
        self.args = server_args
        self.faults = faults
        self.runner = runner
        self.tokenizer = runner.tokenizer
        cfg = runner.model_config
        self.limits = AdmissionLimits.derive(server_args, runner.max_total_num_tokens,
                                             runner.req_to_token_pool.size, cfg.context_length)
        self.kv = self._build_kv(runner, tree)
        self.stats = _new_stats()
        self.weights = WeightControl(runner, self.kv)
        self.storage_control = StorageControl(server_args, runner, self.kv)
        policy = SchedulePolicy(server_args.schedule_policy, self.kv.cache_enabled)
        self.admission = Admission(self.limits, self.kv, policy, faults)
        self.grammars = GrammarQueue(grammar_factory, GRAMMAR_COMPILE_TIMEOUT_S)
        self.masks = MaskBuilder(cfg.vocab_size, self.stats, faults)
        self.outbox = Outbox(server_args.stream_interval, faults)
        jump = None if server_args.disable_jump_forward else JumpForward(self.tokenizer, cfg.vocab_size,
                                                                         self.stats, faults)
        self.jump = jump
        sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, seed=server_args.random_seed)
        self.post = PostProcessor(self.kv, sampler, StopChecker(self.tokenizer, cfg.eos_token_ids),
                                  jump, self.outbox, self.stats, faults)
        self.speculator = build_speculator(server_args, runner, jump is not None, self.stats, faults)
        self.post.speculator = self.speculator
        self.disagg = build_stages(server_args, runner, self.kv, self.admission, self.post, self._fail,
                                   self.stats, faults)
        self.waiting: deque = deque()
        self.running: List[Req] = []
        self.embeds: List[EmbedReq] = []
        self.last_gen_throughput = 0.0
        self._tp_window = (0.0, 0)  # (busy seconds, generated tokens) at the window's start
        self._flushes = 0
        self._recv: Optional[Callable[[bool], list]] = None  # set by run_forever
        self._send: Optional[Callable] = None
        self._stop = False
        self._forward_pool = self._overlap_pool(server_args, runner)
        self.watchdog = Watchdog(server_args.watchdog_timeout)
        self.steps = StepRing()  # the Inspector's timeline
        self.edge_labels: dict = {}  # the Inspector's decoded tree edges, (node id, key length) -> text
        self._step_times = (0.0, 0.0)  # this step's (forward s, CPU s overlapped with it)
        # () -> [transfer dicts with inspect.HANDOFF_FIELDS]: the rooms of a disaggregated server
        self.handoff_probe: Optional[Callable[[], list]] = self.disagg.handoffs if self.disagg is not None else None

    def _build_kv(self, runner, tree) -> KVManager:
        allocator = TokenSlotAllocator(runner.max_total_num_tokens, self.limits.page_size)
        pool = getattr(runner, "token_to_kv_pool", None)  # KV data moves for draft trees
        if tree is None and self.args.enable_hierarchical_cache:
            from lmprog_runtime.cache.hicache_setup import build_hicache
            tree, hicache = build_hicache(self.args, runner, allocator, self.limits.page_size)
            return KVManager(runner.req_to_token_pool, allocator, tree, hicache, pool)
        if tree is None:
            from lmprog_runtime.cache.radix import RadixCache
            tree = RadixCache(allocator, page_size=self.limits.page_size,
                              disable=self.args.disable_radix_cache)
        return KVManager(runner.req_to_token_pool, allocator, tree, kv_pool=pool)

    @staticmethod
    def _overlap_pool(args: ServerArgs, runner):
        on_gpu = getattr(runner.device, "type", "cpu") == "cuda"
        if args.disable_overlap_schedule or not (on_gpu or args.force_overlap_schedule):
            return None
        if args.speculative_algorithm is not None:  # a draft continues the previous step's tokens
            logger.info("speculative decoding is on: the overlap loop is off")
            return None
        from concurrent.futures import ThreadPoolExecutor
        return ThreadPoolExecutor(1, thread_name_prefix="lmprog-forward")

    @property
    def context_len(self) -> int:
        return self.limits.context_len

    # -- inputs ---------------------------------------------------------------------------
    def handle(self, msg) -> Optional[ControlReply]:
        """A message from the tokenizer manager; control messages answer (control.py)."""
        if isinstance(msg, TokenizedGenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        elif isinstance(msg, EmbedReq):
            self.embeds.append(msg)  # run between steps (run_embeds), never beside a forward
        else:
            return control_reply(self, msg)
        return None

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        """Queue a new request; one that cannot even be built or checked fails alone."""
        try:
            req = Req(msg)
            if self.speculator is not None:
                req.spec = SpecCounts()
        except Exception as e:  # e.g. a sampling seed torch cannot take
            logger.exception("request %s failed in %s", msg.rid, Stage.ADMISSION.value)
            return self.outbox.error(msg.rid, len(msg.input_ids), error_reason(Stage.ADMISSION, e))
        try:
            self._arrive(req)
        except Exception as e:
            fail_request(req, Stage.ADMISSION, e)
            self.grammars.remove_matching(lambda r: r is req)
            self._fail(req, req.finished_reason)

    def _arrive(self, req: Req) -> None:
        if self.faults is not None:
            self.faults.check(Stage.ADMISSION, req.rid)
        limit = self.args.max_queued_requests
        if limit is not None and len(self.waiting) + len(self.grammars) >= limit:
            return self._fail(req, FinishReason.error(503, "The request queue is full.", "BadRequest"))
        error = self.weights.refusal() or refusal(req, self.disagg) or self.admission.check(req)
        if error is None and req.sampling.grammar is not None:
            error = self.grammars.submit(req)
            if error is None:
                return
        if error is not None:
            return self._fail(req, error)
        self._enqueue(req)

    def _enqueue(self, req: Req) -> None:
        if self.disagg is not None and self.disagg.takes(req):
            return self.disagg.add(req)  # waits for its other half first
        self.waiting.append(req)
        self.kv.prefetch(req)  # HiCache L3 → L2 while it waits

    def _fail(self, req: Req, reason: FinishReason) -> None:
        req.finish(reason)
        if self.speculator is not None:  # e.g. retracted, then aborted while waiting
            self.speculator.release(req)
        self.outbox.final(req)

    def abort(self, msg: AbortReq) -> None:
        def hit(r):
            return msg.abort_all or (msg.rid and r.rid.startswith(msg.rid))
        reason = FinishReason.abort(msg.message)
        for r in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(r)
            self.kv.forget_prefetch(r)
            self._fail(r, reason)
        for r in self.grammars.remove_matching(hit):
            self._fail(r, reason)
        if self.disagg is not None:
            self.disagg.abort(hit, reason)
        for r in self.running:
            if hit(r):
                r.finish(reason)  # released at the end of the current step

    # -- one step -------------------------------------------------------------------------
    def step(self) -> bool:
        """One plain step; False when there was nothing to compute."""
        t0 = time.perf_counter()
        plan = self._admit()
        if plan.empty:
            return self._idle_step()
        batch = build_forward_batch(plan, self.runner)
        t1 = time.perf_counter()
        logits = self._forward(plan, lambda: self._run_forward(plan, batch))
        self._timed_forward(plan, time.perf_counter() - t1, 0.0)
        mask = self.masks.build(plan.sampled_reqs())
        return self._after_forward(plan, logits, mask, t0)

    def step_overlapped(self) -> bool:
        """Like `step`, with the forward on the worker thread (torch releases the GIL):
        meanwhile this thread sends the previous step's outputs, takes in new requests
        and builds this step's grammar masks."""
        t0 = time.perf_counter()
        plan = self._admit()
        if plan.empty:
            return self._idle_step()
        batch = build_forward_batch(plan, self.runner)
        t1 = time.perf_counter()
        future = self._forward_pool.submit(self._run_forward, plan, batch)
        self._flush()
        self._take_messages(block=False)
        mask = self.masks.build(plan.sampled_reqs())
        t2 = time.perf_counter()
        logits = self._forward(plan, future.result)
        self._timed_forward(plan, time.perf_counter() - t1, t2 - t1)
        return self._after_forward(plan, logits, mask, t0)

    def _timed_forward(self, plan: StepPlan, seconds: float, overlapped: float) -> None:
        self.stats["forward_s"] += seconds
        self._step_times = (seconds, overlapped)
        prompt = sum(it.num_tokens for it in plan.items if it.num_tokens > DECODE_LIKE_EXTEND)
        self.kv.observe_prefill(prompt, seconds)  # HiCache's cost model learns the prefill rate

    def _after_forward(self, plan: StepPlan, logits, mask, t0: float) -> bool:
        """The tail both loops share: sample + post-process, release, account, send."""
        if logits is not None:  # None: the forward failed and so did the batch's requests
            self.post.process(plan, logits, mask)
        if self.disagg is not None:
            self.disagg.after_step()  # prefill: ship finished pages, end finished transfers
        self._release_finished()
        self._end_step(t0, plan)
        self._flush()
        return True

    def _forward(self, plan: StepPlan, compute: Callable):
        """`compute()` → logits; None if it raised: then every request of the batch has
        failed (its slots of this step counted as its own, so release frees them)."""
        try:
            return compute()  # in the overlap loop: waits for the worker, so it writes no more
        except Exception as e:
            for item in plan.items:
                self.kv.commit(item.req, item.num_tokens)  # allocated for this step: freed on release
                fail_request(item.req, Stage.FORWARD, e)
            return None

    def _run_forward(self, plan: StepPlan, batch):
        if self.faults is not None:  # as a failing forward would: nothing computed
            self.faults.check_any(Stage.FORWARD, [it.req.rid for it in plan.items])
        return self.runner.forward(batch)

    def _idle_step(self) -> bool:
        if self.disagg is not None:
            self.disagg.after_step()
            self.disagg.idle_wait(PREFETCH_POLL_S)  # a transfer or handshake is on its way
        self._release_finished()
        self._flush()
        self.kv.wait_for_storage(PREFETCH_POLL_S)  # queued requests may wait on L3 reads
        if len(self.grammars):
            self.grammars.wait(GRAMMAR_POLL_S)  # nothing to compute until a grammar is ready
        return False

    def _admit(self) -> StepPlan:
        """Move compiled grammars to the queue, then admit; applies the queue moves."""
        if len(self.grammars):
            ready, failed = self.grammars.poll()
            for r, reason in failed:
                self._fail(r, reason)
            for r in ready:
                self._enqueue(r)
        if self.disagg is not None:
            to_waiting, to_running = self.disagg.poll(self.running)
            self.waiting.extend(to_waiting)
            self.running.extend(to_running)  # decode: KV arrived, no prefill forward
        drafts = forced_drafts(self.jump, self.speculator, self.running)
        decision = self.admission.admit(self.running, self.waiting, drafts)
        for r in decision.failed:
            self.waiting.remove(r)
            self._fail(r, r.finished_reason)
        if decision.retracted:
            gone = {id(r) for r in decision.retracted}
            self.running = [r for r in self.running if id(r) not in gone]
            self.waiting.extendleft(reversed(decision.retracted))
            self.stats["num_retractions"] += len(decision.retracted)
        for r in decision.admitted:
            self._count_admitted(r)
            self.waiting.remove(r)
            self.running.append(r)
        return decision.plan

    def _count_admitted(self, r: Req) -> None:
        if r.num_retractions == 0 and not r.output_ids:  # first admission: report its cache hit
            r.cached_tokens = r.kv_len
            self.stats["num_prompt_tokens"] += r.prompt_len
            self.stats["num_cached_tokens"] += r.kv_len
            self.kv.count_tier_hits(r)

    def _release_finished(self) -> None:
        keep = []
        for r in self.running:
            if r.finished:
                self.kv.release(r, cache=not r.kv_suspect)
                if self.speculator is not None:
                    self.speculator.release(r)
                self.outbox.final(r)
            else:
                keep.append(r)
        self.running = keep

    def _end_step(self, t0: float, plan: StepPlan) -> None:
        seconds = time.perf_counter() - t0
        self.stats["num_steps"] += 1
        self.stats["step_s"] += seconds
        self.steps.record(seconds, *self._step_times, self.stats["mask_s"], len(plan.items),
                          sum(it.num_tokens for it in plan.items))
        if self.speculator is not None:
            self.speculator.observe_step(plan, seconds)  # its cost rule learns step times
        self._measure_throughput()

    def _measure_throughput(self, window_s: float = 1.0) -> None:
        """`last_gen_throughput`: generated tokens per second of busy (stepping) time,
        over the last `window_s` of it; idle gaps do not dilute it."""
        busy0, tokens0 = self._tp_window
        busy = self.stats["step_s"] - busy0
        if busy >= window_s:
            self.last_gen_throughput = (self.stats["num_generated_tokens"] - tokens0) / busy
            self._tp_window = (self.stats["step_s"], self.stats["num_generated_tokens"])

    def is_idle(self) -> bool:
        return not (self.waiting or self.running or len(self.grammars) or self.embeds
                    or (self.disagg is not None and len(self.disagg)))

    def run_embeds(self) -> None:
        """Answer the queued embedding requests (each fails alone with its message)."""
        embeds, self.embeds = self.embeds, []
        for msg in embeds:
            try:
                vectors = self.runner.embed(msg.prompts, msg.pooling)
                reply = ControlReply("embed", data={"embeddings": vectors})
            except Exception as e:
                logger.exception("embedding request failed")
                reply = ControlReply("embed", success=False, message=f"{type(e).__name__}: {e}")
            self._send(reply)

    # -- sending --------------------------------------------------------------------------
    def _flush(self) -> None:
        """Send this step's deltas (and, every few steps or when going idle, the gauges)."""
        self._flushes += 1
        outputs = self.outbox.take()
        stats = None
        if self._flushes % STATS_EVERY_STEPS == 0 or (outputs and self.is_idle()):
            stats = self.internal_state()
        if (outputs or stats is not None) and self._send is not None:
            self._send_outputs(outputs, stats)

    def _send_outputs(self, outputs: list, stats: Optional[dict]) -> None:
        """An output the channel refuses becomes its request's error; a request still
        running stops too (released, KV freed, at the end of the next step)."""
        for out, exc in self.outbox.send(self._send, outputs, stats):
            for r in self.running:
                if r.rid == out.rid:
                    fail_request(r, Stage.SEND, exc)
            self._send(BatchOutput([error_output(out.rid, out.prompt_tokens, error_reason(Stage.SEND, exc))]))

    # -- control (control.py) --------------------------------------------------------------
    def flush_cache(self) -> ControlReply:
        return flush_cache(self)

    def check_integrity(self) -> None:
        check_integrity(self)

    def internal_state(self) -> dict:
        return internal_state(self)

    # -- the loops ------------------------------------------------------------------------
    def _take_messages(self, block: bool) -> None:
        for msg in self._recv(block):
            if msg is None:  # shutdown
                self._stop = True
                return
            reply = self.handle(msg)
            if reply is not None:
                self._send(reply)

    def run_forever(self, recv: Callable[[bool], list], send: Callable) -> None:
        """`recv(block)` returns pending messages (blocking when idle); `send(obj)` delivers
        outputs and control replies. The overlap loop where a forward pool exists."""
        self._recv, self._send = recv, send
        step = self.step if self._forward_pool is None else self.step_overlapped
        self.watchdog.start()
        try:
            while not self._stop:
                self._take_messages(block=self.is_idle())
                if self._stop:
                    return
                self.run_embeds()
                self.watchdog.step_begin()
                busy = step()
                self.watchdog.step_end()
                if not busy and self.is_idle():
                    self.admission.reset_ratio()
                    self.check_integrity()
        finally:
            self.watchdog.stop()
            self.kv.close()  # HiCache: ends prefetches, waits for queued storage writes
            if self.disagg is not None:
                self.disagg.close()
