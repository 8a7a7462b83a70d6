"""Tool calling for `/v1/chat/completions`: the request side (tools into the prompt, the
constraint for `tool_choice: "required"` / a named function) and the response side
(the model's text into `tool_calls`, also while streaming).

Parsers, by SGLang's `--tool-call-parser` names; each reads the format its model family
was trained on:
    json      the whole answer is {"name", "arguments"|"parameters"} or a list of them
    qwen25    <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call> blocks
    llama3    [<|python_tag|>]{"name": ..., "parameters": {...}}[; {...}]
    pythonic  [get_weather(city="Paris"), get_time()]

`tool_choice: "required"` or `{"type": "function", "function": {"name": N}}` constrains the
answer (through the constraint engine, as a JSON schema) to a JSON list of calls / one
call whose `arguments` follow the tool's `parameters` schema, so the answer always parses;
the `json` parser reads it whatever `--tool-call-parser` says.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass
from typing import List, Optional, Tuple

from lmprog_runtime.generate_request import RequestError

TOOL_CALL_PARSERS = ("json", "pythonic", "llama3", "qwen25")
_QWEN_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object

    def to_openai(self, index: Optional[int] = None) -> dict:
        out = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


# -- the request side --------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses its tools."""

    tools: list                   # the request's tools (OpenAI shape)
    parser: Optional[str]         # the parser reading the answer; None: tools are not used
    constraint: Optional[str]     # a JSON schema the answer must follow (required / named)
    parallel: bool                # several calls allowed (parallel_tool_calls)


def plan_tools(body: dict, server_parser: Optional[str]) -> Optional[ToolPlan]:
    """None when the request uses no tools; 400 (naming the field) for what cannot work."""
    tools, choice = body.get("tools") or [], body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none" or not tools:
        if choice not in ("none", "auto"):
            raise RequestError("tool_choice: a required or named tool choice needs a non-empty tools list.")
        return None
    names = [t["function"]["name"] for t in tools]
    parallel = body.get("parallel_tool_calls") is not False
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        if name not in names:
            raise RequestError(f"tool_choice.function.name: {name!r} is not one of the tools ({', '.join(names)}).")
        return ToolPlan(tools, "json", json.dumps(_call_schema([_tool(tools, name)])), parallel)
    if choice == "required":
        schema = {"type": "array", "minItems": 1, "items": _call_schema(tools)}
        if not parallel:
            schema["maxItems"] = 1
        return ToolPlan(tools, "json", json.dumps(schema), parallel)
    if server_parser is None:
        raise RequestError("tools: with tool_choice \"auto\" the server needs --tool-call-parser "
                           f"({', '.join(TOOL_CALL_PARSERS)}) to read the model's calls; or use "
                           "tool_choice \"required\" or a named function.")
    return ToolPlan(tools, server_parser, None, parallel)


def _tool(tools: list, name: str) -> dict:
    return next(t for t in tools if t["function"]["name"] == name)


def _call_schema(tools: list) -> dict:
    """One call of any of `tools`: {"name": <its name>, "arguments": <its parameters>}."""
    branches = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                 "properties": {"name": {"const": t["function"]["name"]},
                                "arguments": t["function"].get("parameters") or {"type": "object"}}}
                for t in tools]
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


def tool_prompt(plan: ToolPlan) -> str:
    """What a chat template without tool support is told about the tools (a system message)."""
    specs = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in plan.tools)
    example = {"name": "<function name>", "arguments": {"<parameter>": "<value>"}}
    shape = _FORMATS[plan.parser](json.dumps(example))
    return (f"You can call these functions:\n{specs}\nTo call one, answer only with:\n{shape}")


_FORMATS = {
    "json": lambda call: call,
    "qwen25": lambda call: f"<tool_call>\n{call}\n</tool_call>",
    "llama3": lambda call: call.replace('"arguments"', '"parameters"'),
    "pythonic": lambda call: '[function_name(parameter="value")]',
}


def calls_as_text(tool_calls: list, parser: str) -> str:
    """An assistant message's `tool_calls` written the way the model calls (for templates
    that cannot render `tool_calls` themselves)."""
    rendered = []
    for call in tool_calls:
        fn = call.get("function") or {}
        args = fn.get("arguments")
        args = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
        if parser == "pythonic":
            rendered.append(f"{fn.get('name')}({', '.join(f'{k}={v!r}' for k, v in args.items())})")
        else:
            rendered.append(_FORMATS[parser](json.dumps({"name": fn.get("name"), "arguments": args})))
    return f"[{', '.join(rendered)}]" if parser == "pythonic" else "\n".join(rendered)


# -- the response side ---------------------------------------------------------------------------
def parse_tool_calls(text: str, parser: str) -> Tuple[str, List[ToolCall]]:
    """(the text that is not a call, the calls). Text with no well-formed call is all content."""
    return _PARSERS[parser](text)


def _parse_json_calls(text: str) -> Tuple[str, List[ToolCall]]:
    try:
        value = json.loads(text)
    except ValueError:
        return text, []
    calls = _calls_of(value if isinstance(value, list) else [value])
    return ("", calls) if calls else (text, [])


def _calls_of(items) -> List[ToolCall]:
    """Calls from decoded JSON items; [] unless every item is a call."""
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return []
        args = item.get("arguments", item.get("parameters", {}))
        if not isinstance(args, dict):
            return []
        calls.append(ToolCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return calls


def _parse_qwen25(text: str) -> Tuple[str, List[ToolCall]]:
    calls = []
    for block in _QWEN_BLOCK.findall(text):
        _, found = _parse_json_calls(block)
        calls.extend(found)
    if not calls:
        return text, []
    return text[:text.index("<tool_call>")].strip(), calls


def _parse_llama3(text: str) -> Tuple[str, List[ToolCall]]:
    start = text.find(_PYTHON_TAG)
    body = text[start + len(_PYTHON_TAG):] if start >= 0 else text.lstrip()
    if not body.lstrip().startswith("{"):
        return text, []
    calls = []
    for part in body.split(";"):
        _, found = _parse_json_calls(part.strip())
        if not found:
            return text, []
        calls.extend(found)
    return (text[:start].strip() if start >= 0 else ""), calls


def _parse_pythonic(text: str) -> Tuple[str, List[ToolCall]]:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return text, []
    if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                                                 and not c.args for c in tree.elts):
        return text, []
    try:
        calls = [ToolCall(c.func.id, json.dumps({k.arg: ast.literal_eval(k.value) for k in c.keywords},
                                                 ensure_ascii=False)) for c in tree.elts]
    except (ValueError, TypeError):  # a non-literal argument
        return text, []
    return "", calls


_PARSERS = {"json": _parse_json_calls, "qwen25": _parse_qwen25, "llama3": _parse_llama3,
            "pythonic": _parse_pythonic}


def content_prefix_len(text: str, parser: str) -> int:
    """While streaming: how much of `text` is content for sure (a call cannot start in it).
    The rest is held back until the answer is complete."""
    if parser == "qwen25":
        at = text.find("<tool_call>")
        if at >= 0:
            return at
        return len(text) - _marker_prefix_len(text, "<tool_call>")
    stripped = text.lstrip()
    if not stripped:
        return 0
    opener = {"json": "{[", "llama3": "{<", "pythonic": "[<"}[parser]
    return 0 if stripped[0] in opener else len(text)


def _marker_prefix_len(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
