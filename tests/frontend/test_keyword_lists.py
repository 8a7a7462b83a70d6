"""The DSL's keyword lists are defined once and agree: gen_int / gen_string forward every
keyword of their (SGLang) signature to `gen`; run / run_batch take the sampling keywords
of RUN_SAMPLING_DEFAULTS, and each one reaches the program's default sampling params."""

import inspect

import pytest

import lmprog as sgl
from lmprog.api import TYPED_GEN_KEYS
from lmprog.program import RUN_SAMPLING_DEFAULTS, SglFunction, _defaults
from lmprog.ir import SamplingParams

GEN_TO_IR = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
VALUES = {"max_tokens": 7, "n": 2, "stop": ("S",), "stop_token_ids": (5,), "stop_regex": ("R",),
          "temperature": 0.5, "top_p": 0.9, "top_k": 3, "min_p": 0.1, "frequency_penalty": 0.2,
          "presence_penalty": 0.3, "ignore_eos": True, "return_logprob": True, "logprob_start_len": 1,
          "top_logprobs_num": 4, "return_text_in_logprobs": True}


def test_typed_gen_signatures_are_gens_minus_the_rest():
    gen_params = list(inspect.signature(sgl.gen).parameters)
    for fn in (sgl.gen_int, sgl.gen_string):
        params = list(inspect.signature(fn).parameters)
        assert params == ["name", *TYPED_GEN_KEYS]
        assert set(params) <= set(gen_params)
    assert set(VALUES) == set(TYPED_GEN_KEYS)


@pytest.mark.parametrize("fn, dtype", [(sgl.gen_int, "int"), (sgl.gen_string, "str")])
def test_typed_gen_forwards_every_keyword(fn, dtype):
    by_kw = fn("x", **VALUES).sampling_params
    by_pos = fn("x", *[VALUES[k] for k in TYPED_GEN_KEYS]).sampling_params
    assert by_kw == by_pos and by_kw.dtype == dtype
    for key, value in VALUES.items():
        assert getattr(by_kw, GEN_TO_IR.get(key, key)) == value, key
    with pytest.raises(TypeError, match="min_tokens"):
        fn("x", min_tokens=3)


def test_run_and_run_batch_take_the_same_sampling_keywords():
    for fn in (SglFunction.run, SglFunction.run_batch):
        kw = [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]
        assert [k for k in kw if k in RUN_SAMPLING_DEFAULTS] == list(RUN_SAMPLING_DEFAULTS)
    fields = {f for f in SamplingParams.__dataclass_fields__}
    assert set(RUN_SAMPLING_DEFAULTS) <= fields


def test_each_run_keyword_reaches_the_defaults():
    values = {**{GEN_TO_IR.get(k, k): v for k, v in VALUES.items()}, "top_k": 9}
    sp = _defaults(values)
    for key, value in values.items():
        assert getattr(sp, key) == value, key
    assert _defaults({}).max_new_tokens == 128 and _defaults({}).stop == ()
