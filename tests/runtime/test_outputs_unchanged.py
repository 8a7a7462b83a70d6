"""Greedy outputs of a fixed set of requests are token-identical to those recorded in
tests/data/golden_outputs.json (recorded from the code before the scheduler reshape; the
tiny model's `json` / `json_stream` entries re-recorded when cfg, which takes keys in any
order, became the default grammar backend).

Covers plain, batched, streamed, constrained (regex, JSON schema, with jump-forward),
stop strings / stop regexes, n > 1, page_size 16, the overlap loop and the cache on
and off. The real-SmolLM2 subset is the default suite's real-model smoke test (the
longer real-model comparisons are marked `slow`).

Re-record only when a change is meant to alter outputs:
    .venv/bin/python tests/runtime/test_outputs_unchanged.py --record
"""

from __future__ import annotations

import json
import os
import sys

import pytest

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "data", "golden_outputs.json")

PROMPTS = [
    "The capital of France is",
    "List three colors:",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}

# Engine configurations: name -> Engine keyword arguments (tiny model).
CONFIGS = {
    "cache": dict(max_total_tokens=8192),
    "nocache": dict(max_total_tokens=8192, disable_radix_cache=True),
    "page16": dict(max_total_tokens=8192, page_size=16),
    "overlap": dict(max_total_tokens=8192, force_overlap_schedule=True),
    "small_pool": dict(max_total_tokens=640, chunked_prefill_size=64),  # chunking and retraction
}


def _cases():
    """(name, kind, payload): each case is one generate call."""
    greedy = {"temperature": 0, "max_new_tokens": 24}
    return [
        ("single", "generate", dict(prompt=PROMPTS[0], sampling_params=greedy)),
        ("batch", "generate", dict(prompt=PROMPTS, sampling_params=greedy)),
        ("shared_prefix", "generate", dict(
            prompt=[PROMPTS[3] + s for s in (" the", " a dragon", " there lived")],
            sampling_params={"temperature": 0, "max_new_tokens": 16})),
        ("stream", "stream", dict(prompt=PROMPTS[1], sampling_params=greedy)),
        ("stop_str", "generate", dict(prompt=PROMPTS[2], sampling_params={
            "temperature": 0, "max_new_tokens": 32, "stop": [" the", " tempted"]})),
        ("stop_regex", "generate", dict(prompt=PROMPTS[0], sampling_params={
            "temperature": 0, "max_new_tokens": 32, "stop_regex": [r"[0-9]", r"isMa[a-z]"]})),
        ("stop_token", "generate", dict(prompt=PROMPTS[2], sampling_params={
            "temperature": 0, "max_new_tokens": 32, "stop_token_ids": [727],
            "no_stop_trim": True})),
        ("regex", "generate", dict(prompt=PROMPTS[0], sampling_params={
            "temperature": 0, "max_new_tokens": 24, "regex": r"(Paris|London), [A-Z][a-z]{2,8}\."})),
        ("json", "generate", dict(prompt="A person as JSON:", sampling_params={
            "temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(SCHEMA)})),
        ("json_stream", "stream", dict(prompt="A person as JSON:", sampling_params={
            "temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(SCHEMA)})),
        ("n2", "generate", dict(prompt=PROMPTS[2], sampling_params={
            "temperature": 0, "max_new_tokens": 12, "n": 2})),
        ("long", "generate", dict(prompt=PROMPTS[3] * 12, sampling_params={
            "temperature": 0, "max_new_tokens": 40, "ignore_eos": True})),
    ]


def _summary(out):
    if isinstance(out, list):
        return [_summary(o) for o in out]
    reason = out["meta_info"]["finish_reason"]
    return {"text": out["text"], "output_ids": out["output_ids"],
            "finish_reason": {k: reason[k] for k in ("type", "matched", "length") if k in reason}}


def run_cases(engine, names=None) -> dict:
    results = {}
    for name, kind, payload in _cases():
        if names is not None and name not in names:
            continue
        if kind == "stream":
            chunks = list(engine.generate(stream=True, **payload))
            results[name] = {"final": _summary(chunks[-1]),
                             "texts_nondecreasing": all(b["text"].startswith(a["text"])
                                                        for a, b in zip(chunks, chunks[1:]))}
        else:
            results[name] = _summary(engine.generate(**payload))
    engine.check_integrity()
    return results


def _tiny_path(tmp_dir):
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from tiny_model import make_tiny_llama
    return make_tiny_llama(tmp_dir)


def _load():
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_greedy_outputs_unchanged(tiny_model_path, config):
    from engine_helpers import make_engine

    expected = _load()["tiny"][config]
    engine = make_engine(tiny_model_path, random_seed=0, **CONFIGS[config])
    try:
        got = run_cases(engine)
    finally:
        engine.shutdown()
    for name in expected:
        assert got[name] == expected[name], f"{config}/{name} changed"


SMOL_CASES = ("single", "batch", "stream", "regex", "json", "stop_str")


def test_smollm2_greedy_outputs_unchanged():
    from engine_helpers import make_engine

    expected = _load()["smollm2"]
    engine = make_engine("default", random_seed=0, max_total_tokens=8192)
    try:
        got = run_cases(engine, SMOL_CASES)
    finally:
        engine.shutdown()
    for name in SMOL_CASES:
        assert got[name] == expected[name], f"smollm2/{name} changed"


def _record() -> None:
    import tempfile

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from engine_helpers import make_engine

    data = {"tiny": {}, "smollm2": {}}
    with tempfile.TemporaryDirectory() as tmp:
        path = _tiny_path(tmp)
        for config, kwargs in sorted(CONFIGS.items()):
            engine = make_engine(path, random_seed=0, **kwargs)
            try:
                data["tiny"][config] = run_cases(engine)
            finally:
                engine.shutdown()
    engine = make_engine("default", random_seed=0, max_total_tokens=8192)
    try:
        data["smollm2"] = run_cases(engine, SMOL_CASES)
    finally:
        engine.shutdown()
    with open(GOLDEN, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


if __name__ == "__main__":
    if "--record" not in sys.argv:
        sys.exit(__doc__)
    _record()
