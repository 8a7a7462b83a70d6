"""TokenizerManager: the server side of a request, shared by the HTTP server and the Engine.

It validates and tokenizes `/generate`-shaped requests, expands batches and `n`,
sends typed messages to the scheduler, folds the scheduler's deltas into per-request
state, and turns that state into SGLang-shaped response dicts (detokenized text,
stop trimming, logprob triples). It runs on one asyncio loop and never touches the model.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from lmprog_runtime.detokenize import IncrementalDetokenizer
from lmprog_runtime.generate_request import GenerateJob, GenerateParser, RequestError
from lmprog_runtime.messages import (AbortReq, BatchOutput, ControlReply, FinishReason,
                                     FlushCacheReq, FreezeGcReq, GetInternalStateReq, TokenizedGenerateReq)
from lmprog_runtime.sessions import SessionError, SessionStore
from lmprog_runtime.streaming import DeltaCursor, spec_meta, stop_prefix_len

logger = logging.getLogger(__name__)


@dataclass
class ReqState:
    msg: TokenizedGenerateReq
    created: float = field(default_factory=time.monotonic)
    output_ids: List[int] = field(default_factory=list)
    finished_reason: Optional[FinishReason] = None
    meta: Dict[str, Any] = field(default_factory=dict)
    logprobs: Dict[str, list] = field(default_factory=dict)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    detok: Optional[IncrementalDetokenizer] = None  # streamed text so far, built on first use

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None


class TokenizerManager:
    def __init__(self, tokenizer, vocab_size: int, context_len: int, send: Callable[[Any], None],
                 on_finish: Optional[Callable[[ReqState], None]] = None, incremental_streaming: bool = False):
        """`incremental_streaming`: streams send deltas (--incremental-streaming-output)."""
        self.tokenizer = tokenizer
        self.incremental_streaming = incremental_streaming
        self.sessions = SessionStore(getattr(tokenizer, "bos_token_id", None))
        self.weight_version = "default"  # the scheduler's, from its control replies
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.send = send
        self.on_finish = on_finish
        self.states: Dict[str, ReqState] = {}
        self.control_waiters: Dict[str, List[asyncio.Future]] = {}
        self.scheduler_stats: Dict[str, Any] = {}
        self.dead: Optional[str] = None
        self.parser = GenerateParser(tokenizer, vocab_size, context_len, self.sessions, self.states.__contains__)

    def parse(self, obj: dict) -> GenerateJob:
        """Validate and tokenize a /generate body (generate_request.py); RequestError if refused."""
        return self.parser.parse(obj)

    # -- submitting -----------------------------------------------------------------------
    def _submit(self, msg: TokenizedGenerateReq, job: Optional[GenerateJob] = None) -> ReqState:
        if self.dead:
            raise RequestError(f"The scheduler is not running: {self.dead}", status=503)
        if job is not None and job.session is not None:
            try:
                self.sessions.begin(job.session, msg.rid, msg.input_ids)
            except SessionError as e:
                raise RequestError(str(e)) from None
        state = ReqState(msg)
        self.states[msg.rid] = state
        self.send(msg)
        return state

    async def _warm(self, job: GenerateJob) -> None:
        states = [self._submit(w) for w in job.warmups]
        for st in states:
            await self._wait(st)

    async def _wait(self, state: ReqState) -> None:
        while not state.finished:
            await state.event.wait()
            state.event.clear()

    async def generate(self, obj: dict, job: Optional[GenerateJob] = None):
        """Non-streaming: the final dict (or list of dicts for a batch)."""
        job = job or self.parse(obj)
        await self._warm(job)
        states = [self._submit(m, job) for m in job.reqs]
        try:
            for st in states:
                await self._wait(st)
        except asyncio.CancelledError:
            for st in states:
                if not st.finished:
                    self.abort(st.msg.rid)
            raise
        results = [self.response(st, job) for st in states]
        for st in states:
            reason = st.finished_reason
            if reason.is_error:
                raise RequestError(reason.message or "aborted", reason.status_code)
        return results if job.is_batch else results[0]

    async def generate_stream(self, obj: dict, job: Optional[GenerateJob] = None,
                              incremental: Optional[bool] = None) -> AsyncIterator[dict]:
        """Streaming: chunk dicts (with "index" for a batch), cumulative or, with
        `incremental` (default: the server's flag), deltas; errors as {"error": ...}."""
        job = job or self.parse(obj)
        await self._warm(job)
        states = [self._submit(m, job) for m in job.reqs]
        incremental = self.incremental_streaming if incremental is None else incremental
        cursors = [DeltaCursor() for _ in states] if incremental else None
        try:
            pending = set(range(len(states)))
            while pending:
                progressed = False
                for i in sorted(pending):
                    st = states[i]
                    if not st.event.is_set():
                        continue
                    st.event.clear()
                    progressed = True
                    done = st.finished  # read before yielding: the state may finish meanwhile
                    chunk = self._chunk(st, job)
                    if cursors is not None and "error" not in chunk:
                        chunk = cursors[i].delta(chunk)
                    if job.is_batch:
                        chunk["index"] = i
                    yield chunk
                    if done:
                        pending.discard(i)
                if not progressed:
                    await _first_event([states[i].event for i in pending])
        finally:
            for st in states:
                if not st.finished:
                    self.abort(st.msg.rid)

    def _chunk(self, st: ReqState, job: GenerateJob) -> dict:
        reason = st.finished_reason
        if reason is not None and reason.is_error:
            return {"error": {"message": reason.message, "type": "invalid_request_error",
                              "code": reason.status_code, "retryable": False}}
        return self.response(st, job)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.send(AbortReq(rid=rid, abort_all=abort_all))

    async def control(self, kind: str, timeout: float = 30.0, msg=None) -> ControlReply:
        """A control round trip; `msg` (whose reply has this `kind`) defaults to the plain
        request of `kind`."""
        if self.dead:
            raise RequestError(f"The scheduler is not running: {self.dead}", status=503)
        if msg is None:
            msg = {"flush_cache": FlushCacheReq, "internal_state": GetInternalStateReq,
                   "freeze_gc": FreezeGcReq}[kind]()
        fut = asyncio.get_running_loop().create_future()
        self.control_waiters.setdefault(kind, []).append(fut)
        self.send(msg)
        return await asyncio.wait_for(fut, timeout)

    # -- scheduler outputs ----------------------------------------------------------------
    def handle_output(self, obj) -> None:
        if isinstance(obj, ControlReply):
            self.weight_version = obj.data.get("weight_version", self.weight_version)
            waiters = self.control_waiters.get(obj.kind) or []
            if waiters:
                fut = waiters.pop(0)
                if not fut.done():
                    fut.set_result(obj)
            return
        if not isinstance(obj, BatchOutput):
            return
        if obj.stats is not None:
            self.scheduler_stats = obj.stats
        now = time.monotonic()
        for out in obj.outputs:  # each output is delivered, or fails its own request, alone
            try:
                self._apply_output(out, now)
            except Exception as e:
                logger.exception("error handling the output of request %s", out.rid)
                self._fail_request(out.rid, FinishReason.error(500, f"Internal error: {type(e).__name__}: {e}"))

    def _apply_output(self, out, now: float) -> None:
        st = self.states.get(out.rid)
        if st is None:
            return
        if out.output_ids and st.first_token_time is None:
            st.first_token_time = now
        st.last_token_time = now
        if st.detok is not None:
            st.detok.rewind(out.output_offset)
        del st.output_ids[out.output_offset:]
        st.output_ids.extend(out.output_ids)
        st.meta.update(prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
                       cached_tokens=out.cached_tokens, num_retractions=out.num_retractions)
        if out.spec is not None:
            st.meta["spec"] = out.spec
        if st.msg.return_logprob:
            self._fold_logprobs(st, out)
        st.event.set()
        if out.finished_reason is not None:
            self._finish(st, out.finished_reason, now)

    def _finish(self, st: ReqState, reason: FinishReason, now: float) -> None:
        st.finished_reason = reason
        st.meta["e2e_latency"] = now - st.created
        del self.states[st.msg.rid]
        self.sessions.finish(st.msg.rid, st.output_ids, reason.is_error)
        if self.on_finish is not None:
            self.on_finish(st)

    def _fail_request(self, rid: str, reason: FinishReason) -> None:
        """Finish one request with an error (its waiter wakes up) and stop it in the scheduler."""
        st = self.states.get(rid)
        if st is None:
            return
        st.finished_reason = reason
        st.event.set()
        del self.states[rid]
        self.sessions.finish(rid, [], failed=True)
        self.abort(rid)

    @staticmethod
    def _fold_logprobs(st: ReqState, out) -> None:
        lp = st.logprobs
        for name in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
            lst = lp.setdefault(name, [])
            del lst[out.logprob_offset:]
            lst.extend(getattr(out, name))
        for name in ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs"):
            value = getattr(out, name)
            if value is not None:
                lp[name] = value

    def fail_all(self, message: str) -> None:
        """The scheduler died: finish every open request with a 503 instead of hanging."""
        self.dead = message
        self.fail_requests(list(self.states), message)
        for waiters in self.control_waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.set_exception(RequestError(f"The scheduler is not running: {message}", 503))

    def fail_requests(self, rids: List[str], message: str) -> None:
        """The scheduler holding `rids` died (one replica of several): finish them with a 503."""
        for rid in rids:
            st = self.states.pop(rid, None)
            if st is not None:
                st.finished_reason = FinishReason.error(503, f"The scheduler is not running: {message}")
                st.event.set()
                self.sessions.finish(rid, [], failed=True)

    # -- responses ------------------------------------------------------------------------
    def output_text(self, st: ReqState, partial: bool) -> str:
        """The response text: while streaming (`partial`), the incrementally decoded text
        held back where a stop string may be starting; when finished, one full decode
        with the stop trimmed off."""
        sp = st.msg.sampling_params
        if partial:
            if st.detok is None:
                st.detok = IncrementalDetokenizer(
                    self.tokenizer, skip_special_tokens=sp.skip_special_tokens,
                    spaces_between_special_tokens=sp.spaces_between_special_tokens)
            text = st.detok.update(st.output_ids).rstrip("\ufffd")
            return text[:len(text) - stop_prefix_len(text, sp.stop_strs)]
        ids = st.output_ids
        reason = st.finished_reason
        if reason is not None and reason.matched_token and not sp.no_stop_trim:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=sp.skip_special_tokens,
                                     spaces_between_special_tokens=sp.spaces_between_special_tokens)
        matched = reason.matched_str if reason is not None else None
        if matched is not None and not sp.no_stop_trim:
            if matched in sp.stop_regex_strs:
                found = re.search(matched, text)
                cut = found.start() if found else -1
            else:
                cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text

    def response(self, st: ReqState, job: GenerateJob) -> dict:
        reason = st.finished_reason
        meta = {"id": st.msg.rid, "finish_reason": reason.to_dict() if reason is not None else None,
                "prompt_tokens": st.meta.get("prompt_tokens", len(st.msg.input_ids)),
                "completion_tokens": st.meta.get("completion_tokens", len(st.output_ids)),
                "cached_tokens": st.meta.get("cached_tokens", 0),
                "num_retractions": st.meta.get("num_retractions", 0),
                "weight_version": self.weight_version}
        if "spec" in st.meta:
            meta.update(spec_meta(*st.meta["spec"]))
        if st.finished:
            meta["e2e_latency"] = st.meta.get("e2e_latency", time.monotonic() - st.created)
        if st.msg.return_logprob:
            meta.update(self._logprob_meta(st, job.return_text_in_logprobs))
        out = {"text": self.output_text(st, partial=not st.finished), "output_ids": list(st.output_ids),
               "meta_info": meta}
        if job.return_prompt_token_ids:
            out["prompt_token_ids"] = list(st.msg.input_ids)
        return out

    def _logprob_meta(self, st: ReqState, with_text: bool) -> dict:
        def triple(entry):
            if entry is None:
                return None
            lp, tok = entry  # lp is None for the first prompt token
            return [lp, tok, self.tokenizer.decode([tok]) if with_text else None]

        def triples(entries):
            return None if entries is None else [triple(e) for e in entries]

        lp = st.logprobs
        meta = {
            "input_token_logprobs": triples(lp.get("input_token_logprobs", [])),
            "output_token_logprobs": triples(lp.get("output_token_logprobs", [])),
        }
        meta["output_token_logprobs_length"] = len(meta["output_token_logprobs"])
        if st.msg.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [triples(x) for x in lp.get("input_top_logprobs", [])]
            meta["output_top_logprobs"] = [triples(x) for x in lp.get("output_top_logprobs", [])]
        if st.msg.token_ids_logprob:
            meta["input_token_ids_logprobs"] = [triples(x) for x in lp.get("input_token_ids_logprobs", [])]
            meta["output_token_ids_logprobs"] = [triples(x) for x in lp.get("output_token_ids_logprobs", [])]
        return meta


async def _first_event(events: List[asyncio.Event]) -> None:
    waits = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
