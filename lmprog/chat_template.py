"""Chat templates: what text a role block adds before and after its content.

A template comes from, in order of preference:
1. the caller (`RuntimeEndpoint(..., chat_template_name=...)` or `chat_template=`),
2. the server's model: `/get_model_info` carries the model's Jinja `chat_template`;
   `from_jinja` renders it with sentinel messages and reads the role prefixes and
   suffixes, the default system prompt and the stop string off the output,
3. the model path, matched against a small registry (SGLang's names), else `default`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum, auto
from typing import Callable, Dict, List, Optional, Tuple


class ChatTemplateStyle(Enum):
    PLAIN = auto()
    LLAMA2 = auto()


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    default_system_prompt: Optional[str]
    role_prefix_and_suffix: Dict[str, Tuple[str, str]]
    stop_str: Tuple[str, ...] = ()
    image_token: str = "<image>"
    audio_token: str = "<audio>"
    style: ChatTemplateStyle = ChatTemplateStyle.PLAIN

    def get_prefix_and_suffix(self, role: str, hist_messages: List[dict]) -> Tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}; "
                             f"roles: {sorted(self.role_prefix_and_suffix)}.")
        prefix, suffix = self.role_prefix_and_suffix[role]
        if self.style is ChatTemplateStyle.LLAMA2:
            if role == "system" and not hist_messages:
                user_prefix, _ = self.role_prefix_and_suffix["user"]
                prefix = user_prefix + prefix
            elif (role == "user" and len(hist_messages) == 1
                  and hist_messages[0]["content"] is not None and hist_messages[0]["role"] == "system"):
                prefix = ""
        return prefix, suffix

    def get_prompt(self, messages: List[dict]) -> str:
        """Render a whole conversation, as the executor would build it role by role."""
        text, hist = "", []
        if messages and messages[0]["role"] != "system" and self.default_system_prompt:
            messages = [{"role": "system", "content": self.default_system_prompt}] + list(messages)
        for m in messages:
            prefix, suffix = self.get_prefix_and_suffix(m["role"], hist)
            text += prefix + m["content"] + suffix
            hist.append(m)
        return text


_templates: Dict[str, ChatTemplate] = {}
_matchers: List[Callable[[str], Optional[str]]] = []


def register_chat_template(template: ChatTemplate) -> None:
    _templates[template.name] = template


def register_chat_template_matching_function(func: Callable[[str], Optional[str]]) -> None:
    _matchers.append(func)


def get_chat_template(name: str) -> ChatTemplate:
    if name not in _templates:
        raise ValueError(f"unknown chat template {name!r}; registered: {sorted(_templates)}.")
    return _templates[name]


def get_chat_template_by_model_path(model_path: str) -> ChatTemplate:
    for matcher in _matchers:
        name = matcher(model_path)
        if name is not None:
            return get_chat_template(name)
    return get_chat_template("default")


def chat_template_for_model(model_info: dict, name: Optional[str] = None) -> ChatTemplate:
    """The template for a served model: an explicit name, else its Jinja template, else its path."""
    if name is not None:
        return get_chat_template(name)
    jinja_src = model_info.get("chat_template")
    path = model_info.get("model_path") or ""
    if jinja_src:
        derived = from_jinja(jinja_src, name=path or "model")
        if derived is not None:
            return derived
    return get_chat_template_by_model_path(path)


# ---------------------------------------------------------------------------------------------
# Deriving a template from the model's Jinja source

_S, _U, _A, _U2 = "\u2402SYS\u2402", "\u2402USR\u2402", "\u2402AST\u2402", "\u2402USR2\u2402"


def _render(compiled, messages, add_generation_prompt=False) -> Optional[str]:
    try:
        return compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               bos_token="", eos_token="", tools=None)
    except Exception:  # a template may refuse a shape (e.g. assistant first); that shape is unusable
        return None


def _between(text: str, start_marker: Optional[str], end_marker: Optional[str]) -> Optional[str]:
    start = 0 if start_marker is None else text.find(start_marker)
    if start < 0:
        return None
    start += 0 if start_marker is None else len(start_marker)
    end = len(text) if end_marker is None else text.find(end_marker, start)
    return None if end < 0 else text[start:end]


def from_jinja(source: str, name: str = "model") -> Optional[ChatTemplate]:
    """Read role prefixes/suffixes off a Jinja chat template; None when it is not prefix+content+suffix.

    Works for templates where every message renders as `prefix(role) + content + suffix(role)`
    (ChatML, Llama-3, Gemma, SmolLM2, ...), optionally with a default system block inserted
    when the conversation has none. Anything else returns None and the caller falls back
    to path matching.
    """
    try:
        import jinja2.sandbox
    except ImportError:
        return None
    try:
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        compiled = env.from_string(source)
    except Exception:
        return None
    msgs = lambda *pairs: [{"role": r, "content": c} for r, c in pairs]  # noqa: E731
    system_only = _render(compiled, msgs(("system", _S)))
    full = _render(compiled, msgs(("system", _S), ("user", _U), ("assistant", _A), ("user", _U2)))
    user_gen = _render(compiled, msgs(("system", _S), ("user", _U)), add_generation_prompt=True)
    user_no_gen = _render(compiled, msgs(("system", _S), ("user", _U)))
    user_only = _render(compiled, msgs(("user", _U)))
    if None in (system_only, full, user_gen, user_no_gen, user_only) or _S not in system_only:
        return None
    if not user_gen.startswith(user_no_gen):
        return None
    sys_prefix, sys_suffix = system_only.split(_S, 1)
    assistant_prefix = user_gen[len(user_no_gen):]
    user_suffix = _between(full, _U, _A)
    if user_suffix is None:
        return None
    # user_suffix currently holds suffix(user) + prefix(assistant)
    if not user_suffix.endswith(assistant_prefix):
        return None
    user_suffix = user_suffix[: len(user_suffix) - len(assistant_prefix)]
    between_sys_user = _between(full, _S, _U)
    between_ast_user = _between(full, _A, _U2)
    if between_sys_user is None or between_ast_user is None or not between_sys_user.startswith(sys_suffix):
        return None
    user_prefix = between_sys_user[len(sys_suffix):]
    if not between_ast_user.endswith(user_prefix):
        return None
    assistant_suffix = between_ast_user[: len(between_ast_user) - len(user_prefix)]
    if user_prefix == assistant_prefix:
        return None  # the roles are indistinguishable; not a template we can drive role by role
    default_system = _default_system_prompt(user_only, sys_prefix, sys_suffix, user_prefix)
    roles = {"system": (sys_prefix, sys_suffix), "user": (user_prefix, user_suffix),
             "assistant": (assistant_prefix, assistant_suffix)}
    template = ChatTemplate(name=name, default_system_prompt=default_system, role_prefix_and_suffix=roles,
                            stop_str=(assistant_suffix.strip(),) if assistant_suffix.strip() else ())
    expected = template.get_prompt(msgs(("system", _S), ("user", _U), ("assistant", _A), ("user", _U2)))
    return template if expected == full else None


def _default_system_prompt(user_only: str, sys_prefix: str, sys_suffix: str, user_prefix: str):
    head = user_only.split(_U, 1)[0]
    if head == user_prefix or not sys_prefix or not head.startswith(sys_prefix):
        return None
    body = head[len(sys_prefix):]
    if not body.endswith(sys_suffix + user_prefix):
        return None
    return body[: len(body) - len(sys_suffix + user_prefix)] or None


def _raise(message):
    raise ValueError(message)


# ---------------------------------------------------------------------------------------------
# The registry (SGLang's names for the common families)

def _roles(system, user, assistant):
    return {"system": system, "user": user, "assistant": assistant}


_CHATML = _roles(("<|im_start|>system\n", "<|im_end|>\n"), ("<|im_start|>user\n", "<|im_end|>\n"),
                 ("<|im_start|>assistant\n", "<|im_end|>\n"))
_LLAMA3 = _roles(*[(f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>")
                   for r in ("system", "user", "assistant")])

for _t in (
    ChatTemplate("default", None, _roles(("SYSTEM:", "\n"), ("USER:", "\n"), ("ASSISTANT:", "\n"))),
    ChatTemplate("claude", None, _roles(("", ""), ("\n\nHuman: ", ""), ("\n\nAssistant:", ""))),
    ChatTemplate("chatml", None, _CHATML, stop_str=("<|im_end|>",)),
    ChatTemplate("qwen", "You are a helpful assistant.", _CHATML, stop_str=("<|im_end|>",)),
    ChatTemplate("vicuna_v1.1",
                 "A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.",
                 _roles(("", " "), ("USER:", " "), ("ASSISTANT:", "</s>")), image_token=" <image>\n"),
    ChatTemplate("llama-2-chat", None,
                 _roles(("<<SYS>>\n", "\n<</SYS>>\n\n"), ("[INST] ", " [/INST]"), ("", " </s><s>")),
                 style=ChatTemplateStyle.LLAMA2),
    ChatTemplate("mistral", None,
                 _roles(("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"), ("[INST] ", " [/INST]"), ("", " </s><s>")),
                 stop_str=("</s>",)),
    ChatTemplate("llama-3-instruct", None, _LLAMA3, stop_str=("<|eot_id|>",)),
    ChatTemplate("gemma-it", None,
                 _roles(("", ""), ("<start_of_turn>user\n", "<end_of_turn>\n"),
                        ("<start_of_turn>model\n", "<end_of_turn>\n")), stop_str=("<end_of_turn>",)),
    ChatTemplate("deepseek-v3", None,
                 _roles(("", ""), ("<｜User｜>", ""), ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")),
                 stop_str=("<｜end▁of▁sentence｜>",)),
):
    register_chat_template(_t)

_PATH_RULES = (
    (r"tinyllama", "chatml"),
    (r"smollm.*instruct", "chatml"),
    (r"qwen.*vl", "chatml"),
    (r"^(?!.*llava).*qwen.*(chat|instruct)", "qwen"),
    (r"llama-3.*instruct", "llama-3-instruct"),
    (r"llama-2.*chat", "llama-2-chat"),
    (r"(mistral|mixtral).*instruct", "mistral"),
    (r"vicuna|llava-v1\.5", "vicuna_v1.1"),
    (r"gemma.*it", "gemma-it"),
    (r"^(?!.*base).*deepseek-(v3|r1)", "deepseek-v3"),
)


def _match_by_rules(model_path: str) -> Optional[str]:
    lowered = model_path.lower()
    for pattern, name in _PATH_RULES:
        if re.search(pattern, lowered):
            return name
    return None


register_chat_template_matching_function(_match_by_rules)
