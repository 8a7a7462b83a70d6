"""Every `python` block of docs/dsl.md runs, in order, in one namespace (`no-run` blocks are skipped)."""

import os
import re

import lmprog as sgl
from scripted_backend import ScriptedBackend, default_responder

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "dsl.md")
_BLOCK = re.compile(r"^```python( no-run)?\n(.*?)^```", re.S | re.M)


def _responder(prompt, params):
    regex = params.get("regex") or ""
    if regex.startswith(r"(\d{1,3}"):
        return "10.0.0.1"
    if regex.startswith("[0-9]{1,3} [+*]"):
        return "12 * 7"
    return default_responder(prompt, params)


def test_every_example_in_dsl_md_runs(capsys):
    with open(DOC) as f:
        blocks = [(bool(skip), code) for skip, code in _BLOCK.findall(f.read())]
    runnable = [code for skip, code in blocks if not skip]
    assert len(runnable) >= 10
    namespace = {"backend": ScriptedBackend(responder=_responder)}
    try:
        for index, code in enumerate(runnable):
            exec(compile(code, f"docs/dsl.md[block {index}]", "exec"), namespace)
    finally:
        sgl.set_default_backend(None)
    out = capsys.readouterr().out
    assert "failed: the program failed: NotImplementedError" in out
    assert namespace["year"] == 42 and namespace["person"] == {"name": "x", "age": 1}
    assert namespace["state"] is not None
