"""The scheduler: owns the model, the KV pool, the radix cache and the grammars, and
runs the batch loop.

    loop:
        handle incoming requests / aborts / control messages
        plan = admit()                  # running requests' next tokens + new prefill chunks
        logits = forward(plan)          # one ragged forward serves prefill and decode
        process(plan, logits)           # sample, stops, grammar, jump-forward, free, send
        if idle: audit the KV accounting

Every step, each running request contributes the tokens it has not computed yet
(`fill_ids[kv_len:]`): one after a normal decode step, several after a jump-forward
or while its prompt is being prefilled in chunks. So continuous batching, chunked
prefill and jump-forward all fall out of one mechanism.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Callable, List, Optional


from lmprog_runtime.cache.allocator import TokenSlotAllocator
from lmprog_runtime.cache.manager import KVManager
from lmprog_runtime.config import ServerArgs
from lmprog_runtime.messages import (AbortReq, ControlReply, FlushCacheReq,
                                     GetInternalStateReq, TokenizedGenerateReq)
from lmprog_runtime.model.sampler import Sampler
from lmprog_runtime.scheduler.batch import StepPlan, build_forward_batch
from lmprog_runtime.scheduler.output import OutputProcessor
from lmprog_runtime.scheduler.policy import SchedulePolicy, defer_shared_new_prefixes
from lmprog_runtime.scheduler.request import Req

logger = logging.getLogger(__name__)

NEW_TOKEN_CLIP = 4096
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
DECODE_LIKE_EXTEND = 16  # a running request with fewer pending tokens is never budget-limited


class Scheduler:
    def __init__(self, server_args: ServerArgs, runner, tree=None, grammar_factory=None):
        self.args = server_args
        self.runner = runner
        self.tokenizer = runner.tokenizer
        cfg = runner.model_config
        self.page_size = server_args.page_size
        self.allocator = TokenSlotAllocator(runner.max_total_num_tokens, self.page_size)
        if tree is None:
            from lmprog_runtime.cache.radix import RadixCache
            tree = RadixCache(self.allocator, page_size=self.page_size,
                              disable=server_args.disable_radix_cache)
        self.kv = KVManager(runner.req_to_token_pool, self.allocator, tree)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.kv.cache_enabled)
        self.sampler = Sampler(cfg.vocab_size, cfg.eos_token_ids, seed=server_args.random_seed)
        self.grammar_factory = grammar_factory  # () -> grammar backend, called on first use
        self.grammar_backend = None
        self.output = OutputProcessor(self)

        self.context_len = server_args.context_length or cfg.context_length
        self.max_total_tokens = runner.max_total_num_tokens
        self.max_req_len = min(self.context_len - 1, self.max_total_tokens - 1)
        self.max_req_input_len = self.max_req_len - 5
        self.max_running = min(server_args.max_running_requests or runner.req_to_token_pool.size,
                               runner.req_to_token_pool.size)
        self.chunk_size = server_args.chunked_prefill_size or 512
        self.max_prefill_tokens = server_args.max_prefill_tokens

        self.waiting: deque = deque()
        self.grammar_queue: List[Req] = []
        self.running: List[Req] = []
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness, 1.0)
        self.min_ratio = self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR
        self.ratio_decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        # counters for /metrics and server info
        self.stats = {"num_prompt_tokens": 0, "num_cached_tokens": 0, "num_generated_tokens": 0,
                      "num_retractions": 0, "num_steps": 0, "forward_s": 0.0, "step_s": 0.0,
                      "mask_s": 0.0, "mask_rows": 0, "num_jump_forward_tokens": 0}
        self.last_gen_throughput = 0.0
        self._tp_window = (0.0, 0)  # (busy seconds, generated tokens) at the window's start
        self._overlap = None
        on_gpu = getattr(runner.device, "type", "cpu") == "cuda"
        if not server_args.disable_overlap_schedule and (on_gpu or server_args.force_overlap_schedule):
            from concurrent.futures import ThreadPoolExecutor
            self._overlap = ThreadPoolExecutor(1, thread_name_prefix="lmprog-forward")

    # -- inputs ---------------------------------------------------------------------------
    def handle(self, msg) -> Optional[ControlReply]:
        if isinstance(msg, TokenizedGenerateReq):
            self.add_request(msg)
        elif isinstance(msg, AbortReq):
            self.abort(msg)
        elif isinstance(msg, FlushCacheReq):
            return self.flush_cache()
        elif isinstance(msg, GetInternalStateReq):
            return ControlReply("internal_state", data=self.internal_state())
        else:
            raise TypeError(f"unknown message {type(msg).__name__}")
        return None

    def add_request(self, msg: TokenizedGenerateReq) -> None:
        req = Req(msg)
        L = req.prompt_len
        limit = self.args.max_queued_requests
        if limit is not None and len(self.waiting) + len(self.grammar_queue) >= limit:
            return self.output.reject(req, "The request queue is full.", status_code=503)
        if L == 0:
            return self.output.reject(req, "input_ids cannot be empty.")
        if L >= self.max_req_input_len:
            return self.output.reject(
                req, f"Input length ({L} tokens) exceeds the maximum allowed length "
                     f"({self.max_req_input_len} tokens). Use a shorter input.")
        if req.return_logprob and req.logprob_start_len > L:
            return self.output.reject(
                req, f"logprob_start_len={req.logprob_start_len} is higher than the number of "
                     f"input tokens ({L}).")
        sp = req.sampling
        page_room = self.max_total_tokens - (-(-L // self.page_size)) * self.page_size - self.page_size - 1
        sp.max_new_tokens = max(0, min(sp.max_new_tokens, self.max_req_len - L - 1, page_room))
        sp.min_new_tokens = min(sp.min_new_tokens, sp.max_new_tokens)
        if sp.grammar is not None:
            if self.grammar_backend is None and self.grammar_factory is not None:
                try:
                    self.grammar_backend = self.grammar_factory()
                except Exception as e:
                    logger.exception("grammar backend failed to start")
                    return self.output.reject(req, f"The grammar backend could not start: {e}", 500)
            if self.grammar_backend is None:
                return self.output.reject(
                    req, "Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not "
                         "supported when the server is launched with --grammar-backend none")
            req.grammar_future = self.grammar_backend.get_future(*sp.grammar)
            req.grammar_wait_start = time.monotonic()
            self.grammar_queue.append(req)
            return
        self.waiting.append(req)

    def abort(self, msg: AbortReq) -> None:
        def hit(r):
            return msg.abort_all or (msg.rid and r.rid.startswith(msg.rid))
        reason = {"type": "abort", "message": msg.message, "status_code": None, "err_type": None}
        for queue in (self.waiting, self.grammar_queue):
            for r in [r for r in queue if hit(r)]:
                queue.remove(r)
                r.finish(dict(reason))
                self.output.send_final(r)
        for r in self.running:
            if hit(r):
                r.finish(dict(reason))  # released at the end of the current step

    def poll_grammars(self) -> None:
        from lmprog_runtime.config import GRAMMAR_COMPILE_TIMEOUT_S
        still = []
        for r in self.grammar_queue:
            fut = r.grammar_future
            if not fut.done():
                if time.monotonic() - r.grammar_wait_start > GRAMMAR_COMPILE_TIMEOUT_S:
                    fut.cancel()
                    self.output.reject(r, "Grammar preprocessing timed out")
                else:
                    still.append(r)
                continue
            try:
                r.grammar = fut.result()
            except Exception as e:  # compile failure → 400 naming the problem
                self.output.reject(r, str(e))
                continue
            r.grammar_future = None
            self.waiting.append(r)
        self.grammar_queue = still

    # -- one step -------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one batch if there is work; False when idle."""
        if self.grammar_queue:
            self.poll_grammars()
        t0 = time.perf_counter()
        plan = self.admit()
        if plan.empty:
            self.release_finished()
            return False
        fb = build_forward_batch(plan, self.runner)
        t1 = time.perf_counter()
        if self._overlap is not None:
            # The forward runs on a worker thread (torch releases the GIL); meanwhile this
            # thread sends the previous step's outputs, takes in new requests and builds
            # this step's grammar masks.
            future = self._overlap.submit(self.runner.forward, fb)
            self.output.flush()
            self._take_messages(block=False)
            mask = self.output.grammar_masks(plan)
            logits = future.result()
        else:
            logits = self.runner.forward(fb)
            mask = self.output.grammar_masks(plan)
        self.stats["forward_s"] += time.perf_counter() - t1
        self.output.process(plan, logits, mask)
        self.release_finished()
        self.stats["num_steps"] += 1
        self.stats["step_s"] += time.perf_counter() - t0
        self._measure_throughput()
        return True

    def _measure_throughput(self, window_s: float = 1.0) -> None:
        """`last_gen_throughput`: generated tokens per second of busy (stepping) time,
        over the last `window_s` of it; idle gaps do not dilute it."""
        busy0, tokens0 = self._tp_window
        busy = self.stats["step_s"] - busy0
        if busy >= window_s:
            self.last_gen_throughput = (self.stats["num_generated_tokens"] - tokens0) / busy
            self._tp_window = (self.stats["step_s"], self.stats["num_generated_tokens"])

    def release_finished(self) -> None:
        keep = []
        for r in self.running:
            if r.finished:
                self.kv.release(r)
                self.output.send_final(r)
            else:
                keep.append(r)
        self.running = keep

    def is_idle(self) -> bool:
        return not (self.waiting or self.running or self.grammar_queue)

    # -- admission ------------------------------------------------------------------------
    def admit(self) -> StepPlan:
        plan = StepPlan()
        self._schedule_running(plan)
        self._admit_waiting(plan)
        return plan

    def _schedule_running(self, plan: StepPlan) -> None:
        """Give every running request its pending tokens; retract when the pool is short."""
        budget = self.chunk_size
        decode_like = [r for r in self.running if 0 < r.extend_len <= DECODE_LIKE_EXTEND]
        need = sum(self.kv.pages_needed(r.kv_len, r.extend_len) for r in decode_like) * self.page_size
        if need > self.kv.available():
            self.retract(need)
            decode_like = [r for r in self.running if 0 < r.extend_len <= DECODE_LIKE_EXTEND]
        elif decode_like:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        for r in self.running:
            if r.finished or r.extend_len == 0:
                continue
            n = r.extend_len if r in decode_like else min(r.extend_len, budget)
            if n <= 0:
                continue
            loc = self.kv.alloc_extend(r, n)
            if loc is None:
                continue  # a chunked prefill waits for room; decodes were made to fit above
            if r not in decode_like:
                budget -= n
            plan.add(r, n, loc)
        plan.prefill_budget = budget

    def retract(self, need: int) -> None:
        """Move running requests back to the queue until the next decode step fits."""
        victims = sorted(self.running, key=lambda r: (len(r.output_ids), -r.prompt_len))
        retracted = []
        while need > self.kv.available() and len(self.running) > 1 and victims:
            r = victims.pop(0)
            self.running.remove(r)
            self.kv.release(r, cache=True)
            r.reset_for_retraction()
            retracted.append(r)
            need = sum(self.kv.pages_needed(x.kv_len, x.extend_len) for x in self.running
                       if 0 < x.extend_len <= DECODE_LIKE_EXTEND) * self.page_size
        if need > self.kv.available() and len(self.running) == 1:
            r = self.running[0]
            r.finish({"type": "abort", "status_code": 500, "err_type": None,
                      "message": "Out of memory even after retracting all other requests in the decode batch."})
        self.waiting.extendleft(reversed(retracted))
        self.stats["num_retractions"] += len(retracted)
        if retracted:
            decoded = sum(len(r.output_ids) for r in self.running)
            total = sum(r.max_new_tokens for r in self.running)
            self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(self.running)) / (total + 1))
            logger.info("retracted %d request(s); new_token_ratio=%.3f", len(retracted), self.new_token_ratio)

    def _reserved_tokens(self) -> float:
        return sum(min(r.max_new_tokens - len(r.output_ids), NEW_TOKEN_CLIP)
                   for r in self.running) * self.new_token_ratio

    def _admit_waiting(self, plan: StepPlan) -> None:
        if not self.waiting or plan.prefill_budget <= 0:
            return
        ordered = self.policy.order(list(self.waiting), self.kv.match_len)
        deferred = set()
        if self.policy.name == "lpm" and len(ordered) > 1:
            deferred = defer_shared_new_prefixes(ordered, self.kv.match_len)
        budget = plan.prefill_budget
        input_budget = self.max_prefill_tokens
        for r in ordered:
            if len(self.running) >= self.max_running or budget <= 0 or input_budget <= 0:
                break
            if id(r) in deferred:
                continue
            if not self.kv.assign(r):
                break
            n = min(r.extend_len, budget)
            future = min(r.max_new_tokens - len(r.output_ids), NEW_TOKEN_CLIP) * self.new_token_ratio
            room = self.kv.available() - self._reserved_tokens()
            pages = self.kv.pages_needed(r.kv_len, n) * self.page_size
            fits = pages + (future if n == r.extend_len else 0) <= room
            first = not self.running
            loc = self.kv.alloc_extend(r, n) if fits or (first and pages <= self.kv.available()) else None
            if loc is None:  # no room this step: give back the row and the prefix lock
                self.kv.unassign(r)
                break
            if r.num_retractions == 0 and not r.output_ids:
                r.cached_tokens = r.kv_len
                self.stats["num_prompt_tokens"] += r.prompt_len
                self.stats["num_cached_tokens"] += r.kv_len
            self.waiting.remove(r)
            self.running.append(r)
            plan.add(r, n, loc)
            budget -= n
            input_budget -= n

    # -- control --------------------------------------------------------------------------
    def flush_cache(self) -> ControlReply:
        if not self.is_idle():
            return ControlReply("flush_cache", success=False,
                                message="Cache not flushed because there are pending requests.")
        self.kv.flush()
        return ControlReply("flush_cache", message="Cache flushed.")

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.running)

    def internal_state(self) -> dict:
        s = self.stats
        hit = s["num_cached_tokens"] / s["num_prompt_tokens"] if s["num_prompt_tokens"] else 0.0
        tree = self.kv.tree
        return {
            "max_total_num_tokens": self.max_total_tokens,
            "max_req_input_len": self.max_req_input_len,
            "max_running_requests": self.max_running,
            "num_running_reqs": len(self.running),
            "num_queue_reqs": len(self.waiting) + len(self.grammar_queue),
            "num_grammar_queue_reqs": len(self.grammar_queue),
            "num_used_tokens": self.max_total_tokens - self.kv.available(),
            "token_usage": 1 - self.kv.available() / self.max_total_tokens,
            "cache_hit_rate": hit,
            "cached_tokens": tree.total_size() if self.kv.cache_enabled else 0,
            "evictable_tokens": tree.evictable_size() if self.kv.cache_enabled else 0,
            "new_token_ratio": self.new_token_ratio,
            "last_gen_throughput": self.last_gen_throughput,
            "integrity": self._audit() if self.is_idle() else "busy",
            **s,
        }

    def _audit(self) -> str:
        try:
            self.check_integrity()
        except AssertionError as e:
            return f"broken: {e}"
        return "ok"

    # -- the loop -------------------------------------------------------------------------
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
        outputs and control replies."""
        self.output.send = send
        self._recv, self._send = recv, send
        self._stop = False
        while not self._stop:
            self._take_messages(block=self.is_idle())
            if self._stop:
                return
            busy = self.step()
            self.output.flush()
            if not busy and self.is_idle():
                self.new_token_ratio = self.init_ratio
                self.check_integrity()
