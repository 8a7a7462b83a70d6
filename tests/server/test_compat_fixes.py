"""Small things SGLang and OpenAI users reach for first:

- `lmprog-runtime serve --help` documents every flag with its default (and unit);
- `--tp-size/--tp` other than 1 stops at once with "not supported yet";
- SGLang fields for features this server lacks (`data_parallel_rank`, ...) are a 400
  naming the field, never silently ignored (bootstrap fields: tests/disaggregation);
- `/get_model_info` names the real model (the embedded default by its Hugging Face id),
  so SGLang's client picks the right chat template and can load the tokenizer.
"""

import dataclasses
import os
from types import SimpleNamespace

import pytest
import requests

from lmprog.chat_template import get_chat_template_by_model_path
from lmprog_runtime.config import ServerArgs
from lmprog_runtime.server.launch import build_parser, main


def _serve_actions():
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]
    return {a.dest: a for a in serve._actions if a.dest != "help"}


def test_every_serve_flag_has_help_with_its_default():
    actions = _serve_actions()
    assert set(actions) == {f.name for f in dataclasses.fields(ServerArgs)}
    for name, action in actions.items():
        assert action.help and "(default: " in action.help, name
    assert "tokens" in actions["max_total_tokens"].help and "seconds" in actions["watchdog_timeout"].help
    assert "bytes" in actions["max_request_bytes"].help


@pytest.mark.parametrize("flag", ["--tp-size", "--tp"])
def test_tensor_parallelism_is_refused_clearly(flag, capsys):
    assert main(["serve", flag, "2"]) == 2
    assert "tensor parallelism is not supported yet" in capsys.readouterr().err
    with pytest.raises(ValueError, match="tp_size"):
        ServerArgs(tp_size=4)


@pytest.mark.parametrize("field, value", [("data_parallel_rank", 0)])
def test_scale_out_fields_are_a_400_naming_them(live_server, field, value):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, field: value}
    r = requests.post(live_server + "/generate", json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and "not supported yet" in err["message"]
    r = requests.post(live_server + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, field: value},
                      timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field
    body[field] = None  # null means unset, as for every field
    assert requests.post(live_server + "/generate", json=body, timeout=30).status_code == 200


def test_model_info_names_the_served_model(live_server, tiny_model_path):
    info = requests.get(live_server + "/get_model_info", timeout=30).json()
    assert info["model_path"] == tiny_model_path
    assert os.path.isfile(os.path.join(info["tokenizer_path"], "tokenizer.json"))


def test_the_embedded_model_is_reported_by_its_hugging_face_id():
    from lmprog_runtime.engine import model_info
    from lmprog_runtime.model_paths import resolve_model_path

    config = SimpleNamespace(architecture="llama", vocab_size=49152, context_length=2048, eos_token_ids=(2,))
    runner = SimpleNamespace(model_config=config, tokenizer=None, model_path=resolve_model_path("default"))
    info = model_info(ServerArgs(), runner)
    assert info["model_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert info["served_model_name"] == "SmolLM2-135M-Instruct"
    assert get_chat_template_by_model_path(info["model_path"]).name == "chatml"  # SmolLM2's template
