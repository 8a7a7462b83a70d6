"""The /generate request body -> scheduler messages: validation, tokenization, batches and `n`.

`GenerateParser.parse` is the one place a generate request's fields are checked (the HTTP
schema in server/schema.py checks their JSON types first); every refusal is a RequestError
naming the field, answered as HTTP 400 (or `status`).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from lmprog_runtime.messages import Bootstrap, TokenizedGenerateReq
from lmprog_runtime.sampling_params import SamplingParams
from lmprog_runtime.sessions import SESSION_PARAM_KEYS, SessionError, SessionStore

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
class GenerateJob:
    reqs: List[TokenizedGenerateReq]
    is_batch: bool
    stream: bool
    warmups: List[TokenizedGenerateReq]
    return_text_in_logprobs: bool
    return_prompt_token_ids: bool
    session: Optional[dict] = None  # session_params of a request continuing in a session


class GenerateParser:
    def __init__(self, tokenizer, vocab_size: int, context_len: int, sessions: SessionStore,
                 is_live: Callable[[str], bool]):
        """`is_live(rid)`: a request with this id is still in flight (its id cannot be reused)."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.context_len = context_len
        self.sessions = sessions
        self.is_live = is_live

    def parse(self, obj: dict) -> GenerateJob:
        """A /generate body -> the scheduler messages it stands for; RequestError (400) else."""
        self._check_fields(obj)
        is_batch, texts, prompts = self._prompts(obj)
        session = obj.get("session_params")
        if session is not None:
            prompts[0] = self._session_prompt(session, is_batch, prompts[0])
        count = len(prompts)
        params = self._sampling_list(obj.get("sampling_params"), count)
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
        tids = self._token_ids_logprob(obj.get("token_ids_logprob"), count, is_batch)
        stream = bool(obj.get("stream", False))
        boots = self._bootstraps(obj, count, is_batch)
        if n != 1 and any(boots):
            raise RequestError("bootstrap_room: a disaggregated request takes n = 1.")
        if session is not None and n != 1:
            raise RequestError("session_params: a request in a session takes n = 1.")
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
            else:
                warmups.append(self._warmup(params[i], common))
                reqs.extend(self._samples(params[i], n, common))
        return GenerateJob(reqs, is_batch or n > 1, stream, warmups,
                           bool(obj.get("return_text_in_logprobs", False)),
                           bool(obj.get("return_prompt_token_ids", False)), session)

    @staticmethod
    def _check_fields(obj) -> None:
        if not isinstance(obj, dict):
            raise RequestError("The request body must be a JSON object.")
        unknown = sorted(k for k in set(obj) - GENERATE_FIELDS - IGNORED_FIELDS if obj[k] is not None)
        if unknown:
            raise RequestError(f"Unknown field(s) in the request: {', '.join(unknown)}.")
        if obj.get("return_bytes") or obj.get("return_entropy"):  # false is what sglang-router sends
            raise RequestError("return_bytes and return_entropy are not supported yet (only false).")

    def _prompts(self, obj: dict) -> Tuple[bool, List[Optional[str]], List[List[int]]]:
        """(is_batch, texts (None for token prompts), token ids) of text or input_ids."""
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
        return is_batch, texts, prompts

    def _sampling_list(self, value, count: int) -> List[SamplingParams]:
        sp_list = self._per_item(value, count, "sampling_params", True)
        for d in sp_list:
            if d is not None and not isinstance(d, dict):
                raise RequestError(f"sampling_params must be an object, got {type(d).__name__}.")
        return [self._sampling(d) for d in sp_list]

    def _token_ids_logprob(self, tid, count: int, is_batch: bool) -> list:
        tids = tid if (is_batch and tid and isinstance(tid[0], list)) else [tid] * count
        for ids in tids:
            if ids is not None:
                bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
                if bad:
                    raise RequestError(f"token_ids_logprob contains out-of-vocabulary token id {bad[0]}; "
                                       f"valid range is [0, {self.vocab_size}).")
        return tids

    @staticmethod
    def _warmup(params: SamplingParams, common: dict) -> TokenizedGenerateReq:
        """n > 1: one prefill-only request first, so the n samples share its cached prompt."""
        warm = params.clone()
        warm.max_new_tokens, warm.min_new_tokens, warm.n = 0, 0, 1
        return TokenizedGenerateReq(rid=uuid.uuid4().hex, sampling_params=warm, input_ids=common["input_ids"],
                                    cache_salt=common["cache_salt"], extra_key=common["extra_key"])

    @staticmethod
    def _samples(params: SamplingParams, n: int, common: dict) -> List[TokenizedGenerateReq]:
        out = []
        for k in range(n):
            sp = params.clone()
            if sp.sampling_seed is not None:
                sp.sampling_seed += k
            out.append(TokenizedGenerateReq(rid=uuid.uuid4().hex, sampling_params=sp, **common))
        return out

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
            if self.is_live(r):
                raise RequestError(f"Duplicate request ID detected: {r}")
        return rids
