"""Chat templates rendered with jinja2 the way transformers' `apply_chat_template` renders them.

The environment matches transformers' (5.x): a sandbox that cannot mutate its inputs,
`trim_blocks`/`lstrip_blocks`, loop controls, a `{% generation %}` block (rendered as its
body; the server never asks for assistant masks), a `tojson` that does not HTML-escape,
`raise_exception`, `strftime_now`, and `dict`/`namespace` that refuse underscore names.
The template sees `messages`, `tools`, `documents`, `add_generation_prompt`, the named
special tokens (`bos_token`, `eos_token`, ...) and any extra keyword arguments.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any, Dict, List, Optional, Union

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning may come under; templates read the first.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# Appended to the message being continued, found in the output, and cut off there.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` in a template, without the class's attributes."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed attribute names."""

    def __init__(*args, **kwargs):  # noqa: N805 -- jinja's signature trick: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                       dict=_TemplateDict(), namespace=_TemplateNamespace)
    return env.from_string(source)


def plain(value: Any) -> Any:
    """A copy of `value` made of plain JSON types (other objects become "<TypeName>")."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, ...) lose their extra methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    return f"<{type(value).__name__}>"


def normalize_messages(conversation) -> List[dict]:
    """Messages as plain dicts with the keys whose value is None dropped, reasoning aliased."""
    out = []
    for m in conversation:
        if not isinstance(m, dict):
            raise TypeError(f"Chat messages should be dicts, but got {m!r}.")
        m = {k: plain(v) for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render(source: str, conversation: List[dict], tools: Optional[list] = None,
           documents: Optional[list] = None, add_generation_prompt: bool = False,
           continue_final_message: Union[bool, str] = False, **variables) -> str:
    """The text of `conversation` through the template `source`. `variables` are the
    special tokens and extra keyword arguments (extra arguments win)."""
    if not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible.")
    chat = normalize_messages(conversation)
    for tool in tools or ():
        if not isinstance(tool, dict):
            raise ValueError("Tools should be JSON schemas (dicts).")
    for doc in documents or ():
        if not isinstance(doc, dict):
            raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    final = _tag_final_message(chat, source, continue_final_message) if continue_final_message else None
    text = compile_template(source).render(
        messages=chat, tools=plain(tools), documents=plain(documents),
        add_generation_prompt=add_generation_prompt, **plain(variables))
    return _cut_at_tag(text, final) if final is not None else text


def _tag_final_message(chat: List[dict], source: str, which: Union[bool, str]) -> str:
    """Append the continue tag to the final message's field `which`; return its old text."""
    field = which if isinstance(which, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in source for f in fields):
        raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the chat_template')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return final
        raise ValueError("continue_final_message is set but we could not find any text to continue in the final message!")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_tag(text: str, final: str) -> str:
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the chat "
                         "after applying the chat template.")
    at = text.rindex(_CONTINUE_TAG.strip())
    if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return text[:at]
    return text[:at].rstrip()  # the template trimmed the message's trailing space


def select_template(templates: Union[None, str, Dict[str, str]], chat_template: Optional[str],
                    tools: Optional[list]) -> str:
    """The template source to use: an explicit one (or a name in a dict of templates), else
    the model's ("tool_use" when tools are given and present, else "default")."""
    if isinstance(templates, dict):
        if chat_template is not None and chat_template in templates:
            return templates[chat_template]
        if chat_template is None:
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"This model has multiple chat templates with no default: {sorted(templates)}.")
    if chat_template is not None:
        return chat_template
    if templates is None:
        raise ValueError("Cannot use chat template functions because tokenizer.chat_template is not set "
                         "and no template argument was passed!")
    return templates
