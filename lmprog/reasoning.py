"""`separate_reasoning`: split a model's thinking from its answer, per model family."""

from __future__ import annotations

from typing import Optional, Tuple

# model_type -> (think start, think end, whether the output may begin already inside the thinking)
_MARKERS = {
    "deepseek-r1": ("<think>", "</think>", True),
    "qwen3": ("<think>", "</think>", False),
    "qwen3-thinking": ("<think>", "</think>", True),
    "glm45": ("<think>", "</think>", False),
    "kimi": ("\u25c1think\u25b7", "\u25c1/think\u25b7", False),
}


def split(text: str, model_type: Optional[str]) -> Tuple[str, str]:
    """(reasoning, answer) of `text`. Unknown model types are an error naming the known ones."""
    if model_type not in _MARKERS:
        raise ValueError(f"unknown reasoning model_type {model_type!r}; known: {sorted(_MARKERS)}.")
    start, end, may_start_inside = _MARKERS[model_type]
    body = text.lstrip()
    if body.startswith(start):
        body = body[len(start):]
    elif not may_start_inside:
        return "", text
    if end not in body:
        return (body.strip(), "") if may_start_inside or text.lstrip().startswith(start) else ("", text)
    think, answer = body.split(end, 1)
    return think.strip(), answer.lstrip()


def known_model_types():
    return sorted(_MARKERS)
