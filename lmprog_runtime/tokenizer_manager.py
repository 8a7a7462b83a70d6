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
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Dict, List, Optional

from lmprog_runtime.detokenize import IncrementalDetokenizer
from lmprog_runtime.messages import (AbortReq, BatchOutput, Bootstrap, ControlReply, FinishReason,
                                     FlushCacheReq, GetInternalStateReq, TokenizedGenerateReq)
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.sessions import SESSION_PARAM_KEYS, SessionError, SessionStore
from lmprog_runtime.streaming import DeltaCursor, spec_meta, stop_prefix_len

logger = logging.getLogger(__name__)

# /generate fields we implement, and SGLang fields we accept and ignore (they change nothing here).
GENERATE_FIELDS = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "stream", "cache_salt",
    "extra_key", "return_prompt_token_ids", "log_metrics", "session_params",
    "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key",
}
IGNORED_FIELDS = {"lora_path", "priority", "custom_labels", "no_logs", "modalities",
                  "return_hidden_states", "background", "conversation_id", "model",
                  "return_bytes", "return_entropy"}  # the last two: false only


class RequestError(ValueError):
    """A request the runtime refuses; `status` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


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


@dataclass
class GenerateJob:
    reqs: List[TokenizedGenerateReq]
    is_batch: bool
    stream: bool
    warmups: List[TokenizedGenerateReq]
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    session: Optional[dict] = None  # session_params of a request continuing in a session


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

    # -- parsing --------------------------------------------------------------------------
    def parse(self, obj: dict) -> GenerateJob:
        if not isinstance(obj, dict):
            raise RequestError("The request body must be a JSON object.")
        unknown = sorted(k for k in set(obj) - GENERATE_FIELDS - IGNORED_FIELDS if obj[k] is not None)
        if unknown:
            raise RequestError(f"Unknown field(s) in the request: {', '.join(unknown)}.")
        if obj.get("return_bytes") or obj.get("return_entropy"):  # false is what sglang-router sends
            raise RequestError("return_bytes and return_entropy are not supported yet (only false).")
        text, input_ids = obj.get("text"), obj.get("input_ids")
        if input_ids is not None:
            is_batch = bool(input_ids) and isinstance(input_ids[0], list)
            prompts = [self._check_ids(x) for x in (input_ids if is_batch else [input_ids])]
            texts = [None] * len(prompts)
        elif text is not None:
            is_batch = isinstance(text, list)
            texts = text if is_batch else [text]
            if not all(isinstance(t, str) for t in texts):
                raise RequestError("text must be a string or a list of strings.")
            prompts = [self.tokenizer.encode(t) for t in texts]
        else:
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        if is_batch and not prompts:
            raise RequestError("The batch is empty.")
        session = obj.get("session_params")
        if session is not None:
            prompts[0] = self._session_prompt(session, is_batch, prompts[0])
        count = len(prompts)
        sp_list = self._per_item(obj.get("sampling_params"), count, "sampling_params", True)
        for d in sp_list:
            if d is not None and not isinstance(d, dict):
                raise RequestError(f"sampling_params must be an object, got {type(d).__name__}.")
        params = [self._sampling(d) for d in sp_list]
        ns = {p.n for p in params}
        if len(ns) > 1:
            raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")
        n = ns.pop()
        rids = self._rids(obj.get("rid"), count, is_batch)
        per = {k: self._per_item(obj.get(k), count, k, is_batch) for k in
               ("return_logprob", "logprob_start_len", "top_logprobs_num", "cache_salt", "extra_key")}
        for key in ("cache_salt", "extra_key"):  # hashed in the radix tree: strings only
            if any(v is not None and not isinstance(v, str) for v in per[key]):
                raise RequestError(f"{key} must be a string (one per prompt in a batch).")
        tid = obj.get("token_ids_logprob")
        tids = tid if (is_batch and tid and isinstance(tid[0], list)) else [tid] * count
        for ids in tids:
            if ids is not None:
                bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
                if bad:
                    raise RequestError(f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; "
                                       f"valid range is [0, {self.vocab_size}).")
        stream = bool(obj.get("stream", False))
        boots = self._bootstraps(obj, count, is_batch)
        if n != 1 and any(boots):
            raise RequestError("bootstrap_room: a disaggregated request takes n = 1.")
        reqs, warmups = [], []
        for i in range(count):
            self._check_length(prompts[i], params[i])
            common = dict(
                input_ids=prompts[i], input_text=texts[i],
                return_logprob=bool(per["return_logprob"][i]),
                logprob_start_len=self._int(per["logprob_start_len"][i], -1, "logprob_start_len"),
                top_logprobs_num=self._int(per["top_logprobs_num"][i], 0, "top_logprobs_num"),
                token_ids_logprob=tids[i], stream=stream,
                cache_salt=per["cache_salt"][i] or None, extra_key=per["extra_key"][i] or None)
            if n == 1:
                reqs.append(TokenizedGenerateReq(rid=rids[i], sampling_params=params[i],
                                                 bootstrap=boots[i], **common))
                continue
            warm = params[i].clone()
            warm.max_new_tokens, warm.min_new_tokens, warm.n = 0, 0, 1
            warmups.append(TokenizedGenerateReq(
                rid=uuid.uuid4().hex, sampling_params=warm, input_ids=prompts[i],
                cache_salt=common["cache_salt"], extra_key=common["extra_key"]))
            for k in range(n):
                sp = params[i].clone()
                if sp.sampling_seed is not None:
                    sp.sampling_seed += k
                reqs.append(TokenizedGenerateReq(rid=uuid.uuid4().hex, sampling_params=sp, **common))
        if session is not None and n != 1:
            raise RequestError("session_params: a request in a session takes n = 1.")
        return GenerateJob(reqs, is_batch or n > 1, stream, warmups,
                           bool(obj.get("return_text_in_logprobs", False)),
                           bool(obj.get("return_prompt_token_ids", False)), session)

    def _bootstraps(self, obj: dict, count: int, is_batch: bool) -> List[Optional[Bootstrap]]:
        """One Bootstrap (or None) per prompt; a batch's scalar room is room + i (SGLang)."""
        keys = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")
        per = {k: self._per_item(obj.get(k), count, k, is_batch) for k in keys}
        if is_batch and isinstance(obj.get("bootstrap_room"), int):
            per["bootstrap_room"] = [obj["bootstrap_room"] + i for i in range(count)]
        out = []
        for i in range(count):
            host, port, room = (per[k][i] for k in keys[:3])
            if host is None and port is None and room is None:
                out.append(None)
                continue
            if host is None or room is None or not isinstance(room, int) or not 0 <= room < 1 << 63:
                raise RequestError(f"bootstrap_host and bootstrap_room (an integer in [0, 2^63)) are both "
                                   f"needed for a disaggregated request; got host={host!r}, room={room!r}.")
            port = 8998 if port is None else self._int(port, 8998, "bootstrap_port")
            out.append(Bootstrap(host, port, room, per["bootstrap_pair_key"][i]))
        return out

    def _session_prompt(self, params, is_batch: bool, input_ids: List[int]) -> List[int]:
        if is_batch:
            raise RequestError("session_params: a request in a session takes one prompt, not a batch.")
        if not isinstance(params, dict) or set(params) - set(SESSION_PARAM_KEYS):
            raise RequestError("session_params must be an object with id, rid, offset, replace, "
                               f"drop_previous_output; got {params!r}.")
        try:
            return self.sessions.prompt(params, input_ids)
        except SessionError as e:
            raise RequestError(str(e)) from None

    def _check_ids(self, ids) -> List[int]:
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise RequestError("input_ids must be a list of integers or a list of lists of integers.")
        if not ids:
            raise RequestError("input_ids cannot be empty.")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"The input_ids {bad[:8]} contains values greater than the vocab size "
                               f"({self.vocab_size}).")
        return ids

    def _sampling(self, d) -> SamplingParams:
        try:
            sp = SamplingParams.from_dict(d)
            sp.verify(self.vocab_size)
            sp.normalize(self.tokenizer)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e)) from None
        return sp

    def _check_length(self, ids: List[int], sp: SamplingParams) -> None:
        L = len(ids)
        if L == 0:
            raise RequestError("The input is empty.")
        if L >= self.context_len:
            raise RequestError(f"The input ({L} tokens) is longer than the model's context length "
                               f"({self.context_len} tokens).")

    @staticmethod
    def _per_item(value, count: int, name: str, is_batch: bool) -> list:
        """A batch may give one value per prompt as a list; anything else applies to all."""
        if is_batch and isinstance(value, list):
            if len(value) != count:
                raise RequestError(f"{name} has {len(value)} entries for a batch of {count}.")
            return value
        return [value] * count

    @staticmethod
    def _int(value, default: int, name: str) -> int:
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"{name} must be an integer, got {value!r}.")
        return value

    def _rids(self, rid, count: int, is_batch: bool) -> List[str]:
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(count)]
        elif isinstance(rid, str):
            rids = [rid] if not is_batch else [f"{rid}_{i}" for i in range(count)]
        elif isinstance(rid, list) and len(rid) == count and all(isinstance(r, str) for r in rid):
            rids = rid
        else:
            raise RequestError(f"rid must be a string or a list of {count} strings.")
        if len(set(rids)) != len(rids):
            raise RequestError(f"Duplicate request IDs detected within the request: {rids}")
        for r in rids:
            if r in self.states:
                raise RequestError(f"Duplicate request ID detected: {r}")
        return rids

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
            msg = {"flush_cache": FlushCacheReq, "internal_state": GetInternalStateReq}[kind]()
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
