"""`/v1/chat/completions`: messages through the chat template, tools (tools.py), and the
answer as an OpenAI chat completion or a stream of chunks.

With tools in use, the answer's text is read by the tool-call parser: its calls become
`message.tool_calls` (streamed as `delta.tool_calls` once complete) and `finish_reason`
is "tool_calls"; the rest stays `content`. While streaming, content is sent as long as
no call can be starting; what might be a call is held until the answer is complete.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from aiohttp import web

from lmprog_runtime.server.http import RUNTIME, off_loop, write_sse
from lmprog_runtime.server.limits import check_output_room
from lmprog_runtime.server.openai_api import (_base_request, _chat_logprobs, _envelope, _finish, _openai_body,
                                              _output_logprobs, _sampling, _usage, render_chat)
from lmprog_runtime.server.tools import ToolPlan, content_prefix_len, parse_tool_calls, plan_tools
from lmprog_runtime.server.validate import SchemaError
from lmprog_runtime.generate_request import RequestError

_CONSTRAINTS = ("regex", "json_schema", "ebnf", "structural_tag")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    rt = request.app[RUNTIME]
    body = await _openai_body(request, "/v1/chat/completions")
    max_tokens = body.get("max_completion_tokens")
    max_tokens = body.get("max_tokens") if max_tokens is None else max_tokens
    sampling = _sampling(body, max_tokens, rt.args.max_grammar_bytes)
    plan = plan_tools(body, rt.args.tool_call_parser)
    if plan is not None and plan.constraint is not None:
        if any(sampling.get(k) for k in _CONSTRAINTS):
            raise RequestError("tool_choice: a required or named tool choice constrains the answer itself; "
                               "it cannot be combined with response_format, regex, json_schema or ebnf.")
        sampling["json_schema"] = plan.constraint
    obj = _base_request(body, sampling, bool(body.get("stream")))
    top = body.get("top_logprobs")
    if top and not body.get("logprobs"):
        raise SchemaError("top_logprobs", "0 or unset unless logprobs is true", top)
    if body.get("input_ids") is not None:
        obj["input_ids"] = body["input_ids"]
    else:
        obj["input_ids"] = await off_loop(rt, render_chat, rt, body["messages"], body, plan)
    if body.get("logprobs"):
        obj.update(return_logprob=True, top_logprobs_num=top or 0)
    job = await off_loop(rt, rt.tm.parse, obj)
    check_output_room(rt, job, [max_tokens is not None], [bool(body.get("clamp_max_tokens"))],
                      "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens",
                      "clamp_max_tokens")
    n = body.get("n") or 1
    if obj["stream"]:
        return await write_sse(request, _chat_stream(rt, body, obj, job, n, plan))
    results = await rt.tm.generate(obj, job)
    results = results if isinstance(results, list) else [results]
    choices = [_choice(i, r, body, plan) for i, r in enumerate(results)]
    resp = _envelope(obj["rid"], body, rt, "chat.completion", choices)
    resp["usage"] = _usage(results, n)
    return web.json_response(resp)


def _choice(i: int, result: dict, body: dict, plan: Optional[ToolPlan]) -> dict:
    kind, matched = _finish(result)
    content, calls = _read_calls(result["text"], plan)
    lp = _chat_logprobs(*_output_logprobs(result["meta_info"])) if body.get("logprobs") else None
    message = {"role": "assistant", "content": content if (content or not calls) else None,
               "reasoning_content": None, "tool_calls": [c.to_openai() for c in calls] or None}
    return {"index": i, "message": message, "logprobs": lp,
            "finish_reason": "tool_calls" if calls else kind, "matched_stop": matched}


def _read_calls(text: str, plan: Optional[ToolPlan]):
    if plan is None:
        return text, []
    content, calls = parse_tool_calls(text, plan.parser)
    return content, calls if plan.parallel else calls[:1]


class _ChoiceStream:
    """What one choice of a stream has sent: content so far, logprob entries so far."""

    def __init__(self):
        self.sent = ""
        self.num_logprobs = 0

    def content_delta(self, text: str, plan: Optional[ToolPlan], final: bool) -> str:
        """New content to send: everything new without tools; with tools, what cannot be
        part of a call (while running) or the parsed content (when final)."""
        if plan is None:
            upto = text
        elif final:
            upto = _read_calls(text, plan)[0]
        else:
            upto = text[:content_prefix_len(text, plan.parser)] if plan.constraint is None else ""
        delta = upto[len(self.sent):] if upto.startswith(self.sent) else ""
        self.sent += delta
        return delta


async def _chat_stream(rt, body, obj, job, n, plan: Optional[ToolPlan]):
    with_lp = bool(body.get("logprobs"))
    streams: Dict[int, _ChoiceStream] = {}
    finals: Dict[int, dict] = {}

    def chunk_of(i, delta, lp=None, kind=None, matched=None):
        choice = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": kind}
        if kind:
            choice["matched_stop"] = matched
        return _envelope(obj["rid"], body, rt, "chat.completion.chunk", [choice])

    async for chunk in rt.tm.generate_stream(obj, job, incremental=False):
        if "error" in chunk:
            yield chunk
            return
        i = chunk.get("index", 0)
        if i not in streams:
            streams[i] = _ChoiceStream()
            yield chunk_of(i, {"role": "assistant", "content": ""})
        st = streams[i]
        kind, matched = _finish(chunk)
        delta = st.content_delta(chunk["text"], plan, final=kind is not None)
        lp = None
        if with_lp:
            entries, tops = _output_logprobs(chunk["meta_info"], st.num_logprobs)
            st.num_logprobs += len(entries)
            lp = _chat_logprobs(entries, tops) if entries else None
        if delta or lp:
            yield chunk_of(i, {"content": delta}, lp)
        if kind:
            finals[i] = chunk
            calls = _read_calls(chunk["text"], plan)[1]
            if calls:
                yield chunk_of(i, {"tool_calls": [c.to_openai(k) for k, c in enumerate(calls)]})
            yield chunk_of(i, {}, None, "tool_calls" if calls else kind, matched)
    if (body.get("stream_options") or {}).get("include_usage"):
        usage_chunk = _envelope(obj["rid"], body, rt, "chat.completion.chunk", [])
        usage_chunk["usage"] = _usage([finals[i] for i in sorted(finals)], n)
        yield usage_chunk


CHAT_ROUTES: List[tuple] = [("POST", "/v1/chat/completions", chat_completions)]
