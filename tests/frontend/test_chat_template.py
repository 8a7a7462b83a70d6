"""Chat templates: derived from the model's Jinja source, matched by path, or named."""

import pytest

from lmprog.chat_template import (chat_template_for_model, from_jinja, get_chat_template,
                                  get_chat_template_by_model_path)

SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
           "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
           "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
           "{% endif %}")
LLAMA3 = ("{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + "
          "'<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def test_from_jinja_smollm2_reads_roles_default_system_and_stop():
    t = from_jinja(SMOLLM2, "smollm2")
    assert t.role_prefix_and_suffix["user"] == ("<|im_start|>user\n", "<|im_end|>\n")
    assert t.role_prefix_and_suffix["assistant"] == ("<|im_start|>assistant\n", "<|im_end|>\n")
    assert t.default_system_prompt.startswith("You are a helpful AI assistant named SmolLM")
    assert t.stop_str == ("<|im_end|>",)


def test_from_jinja_llama3():
    t = from_jinja(LLAMA3)
    assert t.role_prefix_and_suffix["user"] == ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")
    assert t.default_system_prompt is None and t.stop_str == ("<|eot_id|>",)


def test_from_jinja_rejects_what_it_cannot_read():
    assert from_jinja("{{ raise_exception('no') }}") is None
    assert from_jinja("{% for m in messages %}{{ m['content'] }}{% endfor %}") is None  # no role markers
    assert from_jinja("{% broken") is None


def test_model_info_preference_order():
    info = {"model_path": "meta-llama/Llama-3-8B-Instruct", "chat_template": SMOLLM2}
    assert chat_template_for_model(info).default_system_prompt is not None  # Jinja wins over path
    assert chat_template_for_model({"model_path": info["model_path"]}).name == "llama-3-instruct"
    assert chat_template_for_model(info, "chatml").name == "chatml"  # explicit name wins
    assert chat_template_for_model({"model_path": "unknown/model"}).name == "default"


@pytest.mark.parametrize("path,name", [("TinyLlama/TinyLlama-1.1B-Chat", "chatml"),
                                       ("Qwen/Qwen2-7B-Instruct", "qwen"),
                                       ("mistralai/Mistral-7B-Instruct-v0.2", "mistral"),
                                       ("google/gemma-2-2b-it", "gemma-it"),
                                       ("deepseek-ai/DeepSeek-V3", "deepseek-v3")])
def test_path_matching(path, name):
    assert get_chat_template_by_model_path(path).name == name


def test_llama2_style():
    t = get_chat_template("llama-2-chat")
    msgs = [{"role": "system", "content": "SYS"}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]
    assert t.get_prompt(msgs) == "[INST] <<SYS>>\nSYS\n<</SYS>>\n\nhi [/INST]yo </s><s>[INST] again [/INST]"


def test_unknown_names_are_clear():
    with pytest.raises(ValueError, match="unknown chat template 'nope'"):
        get_chat_template("nope")
    with pytest.raises(ValueError, match="has no role 'tool'"):
        get_chat_template("chatml").get_prefix_and_suffix("tool", [])
