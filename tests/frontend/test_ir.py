"""The IR: immutable nodes, `+` flattening, SamplingParams resolution, and the verbs' validation."""

import dataclasses
import re

import pytest

import lmprog as sgl
from lmprog import ir


def test_nodes_are_immutable_and_concat_flattens():
    g = sgl.gen("x", max_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.name = "y"
    expr = "a" + g + "b" + (sgl.user("u") + "c")
    assert isinstance(expr, ir.ExprList)
    kinds = [type(e).__name__ for e in expr.exprs]
    assert kinds == ["ConstantText", "Gen", "ConstantText", "RoleBegin", "ConstantText", "RoleEnd",
                     "ConstantText"]
    assert expr.named_outputs() == ("x",)
    assert repr(g) == "Gen('x')" and repr(ir.ConstantText("t")) == "Constant('t')"


def test_sampling_params_merge_field_by_field():
    defaults = ir.DEFAULT_SAMPLING_PARAMS.merged(ir.SamplingParams(max_new_tokens=9, stop=["Y"]))
    gen_sp = sgl.gen(max_tokens=3, stop="X").sampling_params
    resolved = defaults.merged(gen_sp).with_extra_stops(("<|im_end|>",))
    assert resolved.max_new_tokens == 3 and resolved.stop == ("X", "<|im_end|>")
    assert resolved.temperature == 1.0 and resolved.top_k == -1


def test_dtype_becomes_regex_and_stops():
    sp = ir.DEFAULT_SAMPLING_PARAMS.merged(sgl.gen_int("n").sampling_params).constrained()
    assert sp.regex == ir.REGEX_INT and sp.stop == (" ", "\n")
    assert ir.DEFAULT_SAMPLING_PARAMS.merged(sgl.gen(dtype="float").sampling_params).constrained().regex \
        == ir.REGEX_FLOAT
    assert sgl.gen_string("s").sampling_params.dtype == "str"
    with pytest.raises(ValueError, match="dtype must be one of"):
        sgl.gen(dtype=list)


def test_runtime_dict_omits_unset_constraints_and_logprob_fields():
    sp = ir.DEFAULT_SAMPLING_PARAMS.merged(ir.SamplingParams(regex="a+", return_logprob=True, top_logprobs_num=2))
    d = sp.to_runtime_dict()
    assert d["regex"] == "a+" and "json_schema" not in d and "return_logprob" not in d
    assert d["stop"] == [] and "stop_regex" not in d
    assert sp.logprob_fields() == {"return_logprob": True, "top_logprobs_num": 2}


def test_gen_validation():
    with pytest.raises(re.error):
        sgl.gen("x", regex="(unclosed")
    with pytest.raises(ValueError, match="non-empty"):
        sgl.gen("x", regex="")
    with pytest.raises(TypeError, match="JSON string"):
        sgl.gen("x", json_schema={"type": "object"})
    with pytest.raises(ValueError, match="non-empty list"):
        sgl.select("x", [])


def test_gen_with_choices_is_select():
    node = sgl.gen("c", choices=["a", "b"], max_tokens=5)
    assert isinstance(node, ir.Select) and node.choices == ("a", "b") and node.temperature == 0.0
    assert node.choices_method is sgl.token_length_normalized


def test_separate_reasoning_shape():
    expr = sgl.separate_reasoning(sgl.gen("test"), model_type="deepseek-r1")
    assert len(expr.exprs) == 2
    node = expr.exprs[1]
    assert node.name == "test_reasoning_content"
    assert repr(node) == "SeparateReasoning(model_type=deepseek-r1, name=test_reasoning_content)"
    with pytest.raises(ValueError, match="name must be provided"):
        sgl.separate_reasoning(sgl.gen(), model_type="qwen3")


def test_argument_placeholder():
    arg = ir.Argument("q")
    with pytest.raises(TypeError, match="f-string"):
        f"{arg}"
    with pytest.raises(ir.StopTracing):
        bool(arg)
    expr = "Q: " + arg
    assert [type(e).__name__ for e in expr.exprs] == ["ConstantText", "ArgumentRef"]
