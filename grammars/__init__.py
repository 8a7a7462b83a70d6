"""Named constraints shipped with lmprog: `get(name) -> (kind, spec)`, `names()`.

Data files live next to this module: `<name>.json` is a JSON Schema (kind "json"),
`<name>.regex` a regex (kind "regex", trailing newline stripped). Pure Python, no
dependencies, so both the language and the runtime may read it.
"""
from __future__ import annotations

from pathlib import Path

_DIR = Path(__file__).resolve().parent
_KINDS = {".json": "json", ".regex": "regex"}


def names() -> list[str]:
    """Names of all shipped grammars, sorted."""
    return sorted(p.stem for p in _DIR.iterdir() if p.suffix in _KINDS)


def get(name: str) -> tuple[str, str]:
    """(kind, spec) of the grammar `name`; KeyError naming the known ones otherwise."""
    for suffix, kind in _KINDS.items():
        path = _DIR / f"{name}{suffix}"
        if path.is_file():
            text = path.read_text(encoding="utf-8")
            return kind, text.rstrip("\n") if kind == "regex" else text
    raise KeyError(f"unknown grammar {name!r}; known: {', '.join(names())}")
