"""Sampled (temperature 1) generation under real-world JSON Schemas (the dev corpus) with
the default grammar engine: no request fails, and every output that stopped is valid.

The tiny random-weight model writes near-uniform noise, so it walks into corners a real
model seldom reaches; this found dead ends that greedy tests never met (a backslash after a
pattern's last character, numbers that no completion could make equal to an enum value).
`slow` runs the whole corpus (about 15 min on 2 cores); the default suite a fixed sample.
"""
import json
import pathlib
import random

import jsonschema
import pytest

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "data" / "jsonschemabench-dev"
PROMPT = "<|im_start|>user\nGive JSON<|im_end|>\n<|im_start|>assistant\n"
FIXED = ["Github_easy---o9828.json"]  # a {24}-hex pattern: where the backslash dead end was


def _schemas(n):
    files = sorted(p.name for p in CORPUS.glob("*.json"))
    random.Random(0).shuffle(files)
    return FIXED + [f for f in files if f not in FIXED][:n]


def _check(engine, names, seeds, max_new_tokens):
    stopped = 0
    for name in names:
        schema = json.loads((CORPUS / name).read_text())["schema"]
        params = [{"max_new_tokens": max_new_tokens, "temperature": 1.0, "json_schema": json.dumps(schema),
                   "sampling_seed": s} for s in range(seeds)]
        for out in engine.generate([PROMPT] * seeds, params):
            if out["meta_info"]["finish_reason"]["type"] == "stop":
                jsonschema.validate(json.loads(out["text"]), schema)  # a stopped output is valid
                stopped += 1
    return stopped


def test_sampling_under_corpus_schemas(tiny_engine):
    assert _check(tiny_engine, _schemas(9), seeds=3, max_new_tokens=160) >= 0


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_sampling_under_the_whole_corpus(tiny_engine):
    assert _check(tiny_engine, _schemas(400), seeds=2, max_new_tokens=200) > 0
