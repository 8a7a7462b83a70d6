"""The cfg engine's per-token modules built by Cython (constrained/cfg/compiled.py): an
extension is imported only where it was built from the module's current source, and the
compiled engine's masks are the Python engine's, bit for bit."""
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from lmprog_runtime.constrained.cfg import compiled

HERE = pathlib.Path(__file__).parent
DEV = HERE.parent / "data" / "jsonschemabench-dev"
SUITE = HERE.parent / "data" / "json-schema-test-suite"
# the suite's groups walked (two of each): checks, captures, references, number bounds
KEYWORDS = ("anyOf", "const", "contains", "dependentSchemas", "dynamicRef", "format", "if-then-else", "minimum",
            "multipleOf", "not", "oneOf", "pattern", "patternProperties", "propertyNames", "ref",
            "unevaluatedItems", "unevaluatedProperties", "uniqueItems")


def _can_build() -> bool:
    if importlib.util.find_spec("Cython") is None:
        return False
    return shutil.which(os.environ.get("CC") or "cc") is not None or shutil.which("gcc") is not None


def _imported_from(module: str, env: dict) -> str:
    code = f"import lmprog_runtime.constrained.cfg.{module} as m; print(m.__file__)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.skipif(not _can_build(), reason="Cython or a C compiler is missing: the engine stays Python")
def test_a_module_is_imported_from_its_extension_only_while_built_from_its_source(tmp_path, monkeypatch):
    from lmprog_runtime import config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path / "cache"))
    assert compiled.build(modules=("classtable",)) == ["classtable"]
    assert compiled.build(modules=("classtable",)) == []  # (built once per source)
    name = f"{compiled.PACKAGE}.classtable"
    spec = compiled._Finder().find_spec(name, None)
    assert spec is not None and spec.origin.startswith(str(tmp_path))
    env = dict(os.environ, LMPROG_CACHE_DIR=str(tmp_path / "cache"))
    assert _imported_from("classtable", env) == spec.origin
    assert _imported_from("machine", env).endswith("machine.py")  # (not built in that cache)
    assert _imported_from("classtable", dict(env, LMPROG_CFG_PURE="1")).endswith("classtable.py")

    edited = tmp_path / "src"  # the module's source changed: its extension is stale, not used
    shutil.copytree(compiled.SOURCE_DIR, edited, ignore=shutil.ignore_patterns("__pycache__"))
    with open(edited / "classtable.py", "a") as f:
        f.write("\n# edited\n")
    monkeypatch.setattr(compiled, "SOURCE_DIR", edited)
    assert compiled._Finder().find_spec(name, None) is None


def digest(tokenizer_dir: str, cases: int) -> dict:
    """The sha256 of every bitmask and verdict of a walk through the instances of the first
    `cases` dev schemas and two groups of each KEYWORDS suite file, and the modules imported
    compiled."""
    import numpy as np
    from transformers import AutoTokenizer

    from lmprog_runtime.constrained import GrammarBackendConfig, create_grammar_backend
    from lmprog_runtime.constrained.base import GrammarError

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    work = [json.loads(p.read_text()) for p in sorted(DEV.glob("*.json"))[:cases]]
    for name in KEYWORDS:
        work += json.loads((SUITE / "draft2020-12" / f"{name}.json").read_text())[:2]
    remotes = (("http://localhost:1234/", str(SUITE / "remotes")),)
    be = create_grammar_backend("cfg", tok, len(tok), [tok.eos_token_id],
                                config=GrammarBackendConfig(schema_remotes=remotes))
    h = hashlib.sha256()
    words = np.zeros(-(-len(tok) // 32), dtype=np.int32)
    try:
        for case in work:
            try:
                g0 = be.get_future("json", json.dumps(case["schema"])).result(timeout=120)
            except GrammarError as exc:
                h.update(f"refused {exc}".encode())
                continue
            for t in case["tests"]:
                g = g0.copy()
                ids = tok.encode(json.dumps(t["data"], separators=(",", ":")), add_special_tokens=False)
                for tid in ids + [tok.eos_token_id]:
                    g.write_bitmask(words)
                    h.update(words.tobytes())
                    if not (words[tid >> 5] >> (tid & 31)) & 1:
                        break
                    try:
                        g.accept_token(tid)
                    except GrammarError:
                        h.update(b"refused")
                        break
    finally:
        be.shutdown()
    return {"sha256": h.hexdigest(), "compiled": compiled.compiled_modules()}


def _digest_in(env: dict, tokenizer_dir: str) -> dict:
    code = (f"import sys, json; sys.path.insert(0, {str(HERE)!r}); from test_cfg_compiled import digest; "
            f"print(json.dumps(digest({tokenizer_dir!r}, 12)))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_compiled_engine_writes_the_python_engines_masks(tokenizer, tmp_path):
    if not (compiled._built("mask") and compiled._built("table")):
        pytest.skip("the cfg extensions are not built (make cfg-compiled)")
    tokenizer.save_pretrained(tmp_path / "tok")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.pop("LMPROG_CFG_PURE", None)
    fast = _digest_in(env, str(tmp_path / "tok"))
    slow = _digest_in(dict(env, LMPROG_CFG_PURE="1"), str(tmp_path / "tok"))
    assert set(fast["compiled"]) >= {"mask", "table", "machine", "canonical"} and slow["compiled"] == []
    assert fast["sha256"] == slow["sha256"]


def test_prune_keeps_the_current_build_and_the_most_recently_used_others(tmp_path, monkeypatch):
    from lmprog_runtime import config

    monkeypatch.setattr(config, "CACHE_DIR", str(tmp_path))
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    root = compiled.cache_dir()
    root.mkdir(parents=True)
    made = []
    for k in range(6):  # six builds of `regex`, the oldest first, and one of regex_parse
        path = root / f"regex-{k:016x}{suffix}"
        path.write_bytes(b"x")
        os.utime(path, (1000 + k, 1000 + k))
        made.append(path)
    other = root / f"regex_parse-{0:016x}{suffix}"
    other.write_bytes(b"x")
    os.utime(other, (1, 1))
    current = made[0]  # (the oldest, now in use again)
    gone = compiled.prune("regex", current)
    assert sorted(gone) == sorted(made[1:3])
    assert [p.exists() for p in made] == [True, False, False, True, True, True]
    assert other.exists() and current.stat().st_mtime > made[5].stat().st_mtime
