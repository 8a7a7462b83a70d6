"""OpenAI-compatible routes: `/v1/models`, `/v1/completions`, `/v1/chat/completions`.

Each request is translated into a `/generate`-shaped dict for the TokenizerManager
(prompt or chat-templated ids, SGLang sampling params, logprob flags), and the
cumulative results are translated back into OpenAI objects and stream chunks.
Choices are prompt-major: prompts A, B with n=2 give choices A#0, A#1, B#0, B#1.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from typing import Dict, List, Optional

from aiohttp import web

from lmprog_runtime.server.http import RUNTIME, off_loop, read_request, write_sse
from lmprog_runtime.server.limits import check_fanout, check_output_room, check_prompt_size
from lmprog_runtime.server.tools import ToolPlan, calls_as_text, tool_prompt
from lmprog_runtime.server.validate import SchemaError
from lmprog_runtime.generate_request import RequestError

_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "frequency_penalty": "frequency_penalty", "presence_penalty": "presence_penalty",
                  "repetition_penalty": "repetition_penalty", "stop": "stop", "stop_token_ids": "stop_token_ids",
                  "ignore_eos": "ignore_eos", "skip_special_tokens": "skip_special_tokens",
                  "no_stop_trim": "no_stop_trim", "n": "n", "logit_bias": "logit_bias", "seed": "sampling_seed",
                  "min_tokens": "min_new_tokens", "regex": "regex", "ebnf": "ebnf", "json_schema": "json_schema"}
_ROLES = ("system", "developer", "user", "assistant", "tool")


# -- request translation ------------------------------------------------------------------------
async def _openai_body(request: web.Request, endpoint: str) -> dict:
    if request.content_type != "application/json":
        raise RequestError("Unsupported Media Type: Only 'application/json' is allowed", 415)
    return await read_request(request, endpoint)


def _sampling(body: dict, max_tokens: Optional[int], max_grammar_bytes: int) -> dict:
    sp = {ours: body[theirs] for theirs, ours in _SAMPLING_KEYS.items() if body.get(theirs) is not None}
    if max_tokens is not None:
        sp["max_new_tokens"] = max_tokens
    rf = body.get("response_format")
    if rf is not None:
        sp.update(_response_format(rf))
        spec = sp.get("json_schema") or sp.get("structural_tag") or ""
        if len(spec) > max_grammar_bytes:
            raise SchemaError("response_format", f"a schema of at most {max_grammar_bytes} bytes of JSON "
                                                 "(--max-grammar-bytes)", None, f"{len(spec)} bytes")
    return sp


def _response_format(rf: dict) -> dict:
    kind = rf.get("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        return {"json_schema": '{"type": "object"}'}
    if kind == "json_schema":
        spec = rf.get("json_schema") if isinstance(rf.get("json_schema"), dict) else rf
        schema = spec.get("schema", spec.get("schema_"))
        if not isinstance(schema, dict):
            raise RequestError("response_format.json_schema.schema must be a JSON Schema object.")
        return {"json_schema": json.dumps(schema)}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps({k: v for k, v in rf.items() if k != "type"})}
    raise RequestError(f"response_format.type must be one of text, json_object, json_schema, "
                       f"structural_tag; got {kind!r}.")


BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")


def _base_request(body: dict, sampling: dict, stream: bool) -> dict:
    return {"sampling_params": sampling, "stream": stream, "rid": body.get("rid") or uuid.uuid4().hex,
            "return_text_in_logprobs": True, "cache_salt": body.get("cache_salt"),
            "extra_key": body.get("extra_key"),
            **{k: body.get(k) for k in BOOTSTRAP_FIELDS}}


def render_chat(rt, messages, body: dict, plan: Optional[ToolPlan] = None) -> List[int]:
    """Token ids of `messages` through the model's chat template (with a generation prompt).
    A template that cannot render tools gets them as a system message, and earlier
    assistant `tool_calls` as text in the parser's format."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list.")
    conv = [_message(m, i) for i, m in enumerate(messages)]
    template = _chat_template(rt)
    if template is None:
        raise RequestError("The model has no chat template; start the server with --chat-template.")
    if plan is not None and "tools" not in template:
        conv = _tools_as_text(conv, plan)
    cont = bool(body.get("continue_final_message")) and conv[-1]["role"] == "assistant"
    try:
        text = rt.tokenizer.apply_chat_template(
            conv, tokenize=False, add_generation_prompt=not cont, continue_final_message=cont,
            chat_template=template, tools=body.get("tools"), **(body.get("chat_template_kwargs") or {}))
    except Exception as e:  # jinja raise_exception(), missing variables, ...
        raise RequestError(f"Cannot apply the chat template: {e}") from None
    return rt.tokenizer.encode(text, add_special_tokens=False)


def _tools_as_text(conv: List[dict], plan: ToolPlan) -> List[dict]:
    written = []
    for m in conv:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = calls_as_text(m["tool_calls"], plan.parser)
            m = {**m, "content": f"{m['content']}\n{calls}" if m["content"] else calls}
        written.append(m)
    conv = written
    prompt = tool_prompt(plan)
    if conv[0]["role"] in ("system", "developer"):
        return [{**conv[0], "content": conv[0]["content"] + "\n\n" + prompt}] + conv[1:]
    return [{"role": "system", "content": prompt}] + conv


def _message(m, i: int) -> dict:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        raise RequestError(f"messages[{i}] must be an object with a string role.")
    if m["role"] not in _ROLES:
        raise RequestError(f"messages[{i}].role must be one of {', '.join(_ROLES)}; got {m['role']!r}.")
    content = m.get("content")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"messages[{i}].content: only text parts are supported.")
            parts.append(part["text"])
        content = "".join(parts)
    if content is not None and not isinstance(content, str):
        raise RequestError(f"messages[{i}].content must be a string or a list of text parts.")
    return {**m, "content": content or ""}


def _chat_template(rt) -> Optional[str]:
    template = rt.args.chat_template
    if template and os.path.isfile(template):
        with open(template, encoding="utf-8") as f:
            return f.read()
    return template or getattr(rt.tokenizer, "chat_template", None)


# -- response pieces ---------------------------------------------------------------------------
def _finish(result: dict):
    reason = result["meta_info"]["finish_reason"]
    if reason is None:
        return None, None
    return reason.get("type"), reason.get("matched")


def _usage(results: List[dict], n: int) -> dict:
    prompt = sum(r["meta_info"]["prompt_tokens"] for r in results[::n])
    completion = sum(r["meta_info"]["completion_tokens"] for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": None}


def _completion_logprobs(entries, tops, start_offset: int = 0) -> dict:
    tokens, offsets, offset = [], [], start_offset
    for e in entries:
        text = e[2] if e is not None else ""
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"text_offset": offsets, "token_logprobs": [None if e is None else e[0] for e in entries],
            "tokens": tokens,
            "top_logprobs": [None if t is None else {x[2]: x[0] for x in t} for t in tops]}


def _chat_logprobs(entries, tops) -> dict:
    def item(e):
        return {"token": e[2], "logprob": e[0], "bytes": list(e[2].encode("utf-8"))}

    return {"content": [{**item(e), "top_logprobs": [item(x) for x in (t or [])]}
                        for e, t in zip(entries, tops)]}


def _output_logprobs(meta: dict, start: int = 0):
    entries = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [None] * len(entries)
    return entries[start:], tops[start:]


def _envelope(rid: str, body: dict, rt, obj_type: str, choices: list) -> dict:
    return {"id": rid, "object": obj_type, "created": int(time.time()),
            "model": body.get("model") or rt.model_info["served_model_name"], "choices": choices}


# -- /v1/completions -------------------------------------------------------------------------
async def completions(request: web.Request) -> web.StreamResponse:
    rt = request.app[RUNTIME]
    body = await _openai_body(request, "/v1/completions")
    prompt = body["prompt"]
    batch = isinstance(prompt, list) and isinstance(prompt[0], (str, list))
    check_fanout(rt, len(prompt) if batch else 1, body.get("n") or 1, "n")
    check_prompt_size(rt, prompt if isinstance(prompt, str) or isinstance(prompt[0], str) else None, "prompt")
    max_tokens = body.get("max_tokens")
    sampling = _sampling(body, 16 if max_tokens is None else max_tokens, rt.args.max_grammar_bytes)
    obj = _base_request(body, sampling, bool(body.get("stream")))
    prompt_texts = await off_loop(rt, _set_prompt, rt, obj, prompt)
    logprobs, echo = body.get("logprobs"), bool(body.get("echo"))
    if logprobs is not None:
        obj.update(return_logprob=True, top_logprobs_num=logprobs, logprob_start_len=0 if echo else -1)
    job = await off_loop(rt, rt.tm.parse, obj)
    check_output_room(rt, job, [max_tokens is not None], [bool(body.get("clamp_max_tokens"))], "max_tokens",
                      "clamp_max_tokens")
    n = body.get("n") or 1
    if obj["stream"]:
        return await write_sse(request, _completion_stream(rt, body, obj, job, prompt_texts, n))
    results = await rt.tm.generate(obj, job)
    results = results if isinstance(results, list) else [results]
    choices = []
    for i, r in enumerate(results):
        prefix = prompt_texts[i // n] if echo else ""
        kind, matched = _finish(r)
        lp = None
        if logprobs is not None:
            entries, tops = _output_logprobs(r["meta_info"])
            if echo:
                ids = job.reqs[i].input_ids
                in_entries = [e if e is not None else [None, ids[k], rt.tokenizer.decode([ids[k]])]
                              for k, e in enumerate(r["meta_info"].get("input_token_logprobs") or [])]
                in_tops = r["meta_info"].get("input_top_logprobs") or [None] * len(in_entries)
                entries, tops = in_entries + entries, in_tops + tops
            lp = _completion_logprobs(entries, tops)
        choices.append({"index": i, "text": prefix + r["text"], "logprobs": lp, "finish_reason": kind,
                        "matched_stop": matched})
    resp = _envelope(obj["rid"], body, rt, "text_completion", choices)
    resp["usage"] = _usage(results, n)
    return web.json_response(resp)


def _set_prompt(rt, obj: dict, prompt) -> List[str]:
    """Put the prompt into `obj`; return the prompt texts (for echo)."""
    if isinstance(prompt, str):
        obj["text"] = prompt
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        obj["text"] = prompt
        return list(prompt)
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        obj["input_ids"] = prompt
        return [rt.tokenizer.decode(prompt)]
    if all(isinstance(p, list) and p for p in prompt):
        obj["input_ids"] = prompt
        return [rt.tokenizer.decode(p) if all(isinstance(t, int) for t in p) else "" for p in prompt]
    raise RequestError("prompt must be a string, a list of strings, a list of token ids, "
                       "or a list of lists of token ids.")


async def _completion_stream(rt, body, obj, job, prompt_texts, n):
    echo, with_lp = bool(body.get("echo")), body.get("logprobs") is not None
    sent_text: Dict[int, str] = {}
    sent_lp: Dict[int, int] = {}
    finals: Dict[int, dict] = {}
    async for chunk in rt.tm.generate_stream(obj, job, incremental=False):  # deltas computed here
        if "error" in chunk:
            yield chunk
            return
        i = chunk.get("index", 0)
        prev = sent_text.get(i)
        prefix = prompt_texts[i // n] if echo else ""
        delta = chunk["text"][len(prev):] if prev is not None else prefix + chunk["text"]
        sent_text[i] = chunk["text"]
        kind, matched = _finish(chunk)
        lp = None
        if with_lp:
            entries, tops = _output_logprobs(chunk["meta_info"], sent_lp.get(i, 0))
            sent_lp[i] = sent_lp.get(i, 0) + len(entries)
            offset = len(prefix) + len(prev or "")
            lp = _completion_logprobs(entries, tops, offset) if entries else None
        if delta or kind or lp:
            yield _envelope(obj["rid"], body, rt, "text_completion",
                            [{"index": i, "text": delta, "logprobs": lp, "finish_reason": kind,
                              "matched_stop": matched}])
        if kind:
            finals[i] = chunk
    if (body.get("stream_options") or {}).get("include_usage"):
        usage_chunk = _envelope(obj["rid"], body, rt, "text_completion", [])
        usage_chunk["usage"] = _usage([finals[i] for i in sorted(finals)], n)
        yield usage_chunk


# -- /v1/models --------------------------------------------------------------------------------
def _model_card(rt) -> dict:
    info = rt.model_info
    return {"id": info["served_model_name"], "object": "model", "created": int(rt.start_time),
            "owned_by": "lmprog", "root": info["model_path"], "parent": None,
            "max_model_len": rt.tm.context_len}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request.app[RUNTIME])]})


async def retrieve_model(request: web.Request) -> web.Response:
    rt = request.app[RUNTIME]
    name = request.match_info["model"]
    if name != rt.model_info["served_model_name"]:
        body = {"error": {"message": f"The model '{name}' does not exist", "type": "invalid_request_error",
                          "param": "model", "code": "model_not_found"}}
        return web.json_response(body, status=404)
    return web.json_response(_model_card(rt))


OPENAI_ROUTES = [
    ("GET", "/v1/models", list_models), ("GET", "/v1/models/{model}", retrieve_model),
    ("POST", "/v1/completions", completions),
]
