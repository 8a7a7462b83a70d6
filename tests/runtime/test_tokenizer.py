"""The server's torch-free tokenizer (`lmprog_runtime.tokenizer`) gives exactly the ids, text and
chat-template output of the transformers tokenizer of the same files: SmolLM2's tokenizer as
converted from the embedded GGUF (the cache folder) and as saved in the tiny test model's folder."""

import json
import os
import random
import subprocess
import sys

import jinja2
import pytest

from lmprog_runtime.model_paths import gguf_cache_dir, resolve_model_path, tokenizer_folder
from lmprog_runtime.tokenizer import Tokenizer, load_tokenizer
from tiny_model import smollm2_tokenizer

CORPUS = [
    "", " ", "a", "Hello, world!", "  leading and trailing  ", "tabs\tand\nnewlines\r\n\n\n",
    " " * 17 + "x" + "\n" * 5 + "\t\t ", "Ünïcödé — 日本語のテキスト, Привет, مرحبا, שלום, हिन्दी",
    "emoji 🎉🎉 👩‍👩‍👧 🏳️‍🌈 ✅ 🤖", "mixed\u00a0nbsp\u200bzero-width\ufeffbom",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|><|im_end|>text<|im_start|>",
    "not special: <|im_start |> <| im_end|> <im_start>", "def f(x):\n    return x ** 2  # ∑ √ ∞\n",
    "Numbers 1234567890 3.14159 -42 1e-9 0x1F", "URL https://example.com/a?b=c&d=e#f",
    "{\"json\": [1, 2, {\"k\": null}], \"s\": \"q\\\"uote\"}", "can't won't I'm you're they've it's .,!?",
    "lorem ipsum dolor sit amet " * 300,
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
     {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2 😀\n\n  spaced  "}],
    [{"role": "user", "content": "multi\nline\n"}, {"role": "assistant", "content": "Sure: "}],
    [{"role": "user", "content": "<|im_end|> inside text"}, {"role": "assistant", "content": None}],
]
# Exercises what the environment provides: loop controls, namespace, tojson without HTML
# escaping, strftime_now, bos/eos variables, a {% generation %} block, trim/lstrip blocks.
CUSTOM_TEMPLATE = """{{ bos_token }}{% set ns = namespace(n=0) %}
{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
  {% set ns.n = ns.n + 1 %}
  [{{ ns.n }}:{{ m.role }}] {{ m.content | tojson }}
  {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% endif %}
{% endfor %}
{% if tools %}tools={{ tools | tojson(indent=2) }}{% endif %}
{% if documents %}{% for d in documents %}<doc {{ d.title }}>{% endfor %}{% endif %}
year={{ strftime_now('%Y') }} extra={{ extra_var | default('none') }} {{ dict(a=1) | tojson }}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def outcome(fn, *args, **kwargs):
    """The result of a call, or the type and message of what it raised (so that an error
    in a template, e.g. a message without content, must be the same error)."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        return (type(e).__name__, str(e))


def same_template_output(ours, hf, conv, **kw):
    mine = outcome(ours.apply_chat_template, conv, **kw)
    assert mine == outcome(hf.apply_chat_template, conv, **kw), (conv, kw)
    return mine


@pytest.fixture(scope="module")
def pairs(tiny_model_path):
    """(ours, transformers') for the GGUF-converted folder and the tiny model's folder."""
    from transformers import AutoTokenizer

    converted = tokenizer_folder(resolve_model_path("default"))
    smollm2_tokenizer()  # the same conversion through transformers
    return {"converted": (Tokenizer.from_folder(converted), AutoTokenizer.from_pretrained(converted)),
            "tiny": (load_tokenizer(tiny_model_path), AutoTokenizer.from_pretrained(tiny_model_path))}


@pytest.fixture(params=["converted", "tiny"])
def pair(request, pairs):
    return pairs[request.param]


def test_vocabulary_and_special_tokens(pair):
    ours, hf = pair
    assert len(ours) == len(hf) and ours.vocab_size == hf.vocab_size
    assert ours.special_tokens_map == hf.special_tokens_map
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (hf.eos_token_id, hf.bos_token_id,
                                                                        hf.pad_token_id)
    assert ours.all_special_tokens == hf.all_special_tokens and ours.all_special_ids == hf.all_special_ids
    assert ours.chat_template == hf.chat_template
    assert ours.get_vocab() == hf.get_vocab()  # the boundary sizes prompts by the longest token


@pytest.mark.parametrize("add_special", [True, False])
def test_encode_and_decode_match(pair, add_special):
    ours, hf = pair
    for text in CORPUS:
        ids = ours.encode(text, add_special_tokens=add_special)
        assert ids == hf.encode(text, add_special_tokens=add_special), text[:40]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)


def test_decode_of_arbitrary_ids_matches(pair):
    """Random ids (partial UTF-8 byte tokens, specials in the middle) and single ids."""
    ours, hf = pair
    rng = random.Random(0)
    for n in list(range(1, 12)) + [64, 500]:
        ids = [rng.randrange(len(hf)) for _ in range(n)] + [rng.choice(hf.all_special_ids)]
        rng.shuffle(ids)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    for i in list(range(0, 300)) + [len(hf) - 1]:
        assert ours.decode([i]) == hf.decode([i]) and ours.decode(i) == hf.decode(i)


@pytest.mark.parametrize("gen", [True, False])
def test_model_chat_template_matches(pair, gen):
    ours, hf = pair
    for conv in CONVERSATIONS:
        same_template_output(ours, hf, conv, tokenize=False, add_generation_prompt=gen)
        assert outcome(ours.apply_chat_template, conv, add_generation_prompt=gen) == \
            outcome(hf.apply_chat_template, conv, add_generation_prompt=gen, return_dict=False)
    assert isinstance(same_template_output(ours, hf, CONVERSATIONS[2], tokenize=False), str)


def test_continue_final_message_matches(pair):
    ours, hf = pair
    conv = CONVERSATIONS[3]
    kw = dict(tokenize=False, continue_final_message=True)
    assert ours.apply_chat_template(conv, **kw) == hf.apply_chat_template(conv, **kw)
    assert ours.apply_chat_template(conv, **kw).endswith("<|im_start|>assistant\nSure: ")


@pytest.mark.parametrize("gen", [True, False])
def test_custom_template_with_tools_documents_and_kwargs_matches(pair, gen):
    ours, hf = pair
    tools = [{"type": "function", "function": {"name": "f", "description": "é <b>&</b>",
                                               "parameters": {"type": "object", "properties": {}}}}]
    docs = [{"title": "T1", "text": "x"}, {"title": "T2", "text": "y"}]
    for conv in CONVERSATIONS:
        for extra in ({}, {"extra_var": "ünï"}, {"eos_token": "OVERRIDDEN"}):
            same_template_output(ours, hf, conv, tokenize=False, add_generation_prompt=gen,
                                 chat_template=CUSTOM_TEMPLATE, tools=tools, documents=docs, **extra)


def test_template_errors_are_raised_like_transformers(pair):
    ours, hf = pair
    conv = CONVERSATIONS[0]
    raising = "{% if messages[0].role == 'user' %}{{ raise_exception('no users here') }}{% endif %}"
    for tok in (ours, hf):
        with pytest.raises(jinja2.exceptions.TemplateError, match="no users here"):
            tok.apply_chat_template(conv, tokenize=False, chat_template=raising)
    escaping = "{% set ns = namespace() %}{% set ns._x = 1 %}"
    for tok in (ours, hf):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(conv, tokenize=False, chat_template=escaping)
    mutating = "{{ messages.append(1) }}"
    for tok in (ours, hf):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template(conv, tokenize=False, chat_template=mutating)
    for tok in (ours, hf):
        with pytest.raises(ValueError):
            tok.apply_chat_template([], tokenize=False)


def test_named_templates_are_selected_like_transformers(pairs):
    ours, hf = pairs["converted"]
    named = {"default": "D{{ messages[0].content }}", "tool_use": "T{{ tools | length }}"}
    conv, tools = CONVERSATIONS[0], [{"name": "f"}]
    saved = ours.chat_template, hf.chat_template
    try:
        ours.chat_template = hf.chat_template = named
        for kw in ({}, {"tools": tools}, {"chat_template": "tool_use", "tools": tools}):
            assert ours.apply_chat_template(conv, tokenize=False, **kw) == \
                hf.apply_chat_template(conv, tokenize=False, **kw)
    finally:
        ours.chat_template, hf.chat_template = saved


def test_loading_never_imports_torch_or_transformers_and_converts_in_a_child(tmp_path):
    """With an empty cache the GGUF tokenizer is converted by a child process, and a corrupt
    cache is rebuilt the same way; the loading process itself never imports torch,
    transformers or numpy."""
    code = ("import sys, json\n"
            "from lmprog_runtime.tokenizer import load_tokenizer\n"
            "from lmprog_runtime.model_paths import gguf_cache_dir, resolve_model_path\n"
            "tok = load_tokenizer('default')\n"
            "print(json.dumps({'ids': tok.encode('Hello 😀'), 'cache': gguf_cache_dir(resolve_model_path('default')),"
            " 'modules': sorted(m for m in ('torch', 'transformers', 'numpy') if m in sys.modules)}))\n")
    env = {**os.environ, "LMPROG_CACHE_DIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    expected = smollm2_tokenizer().encode("Hello 😀")
    for attempt in ("empty cache", "corrupt cache"):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, (attempt, out.stderr[-2000:])
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["modules"] == [] and result["ids"] == expected, attempt
        tokenizer_json = os.path.join(result["cache"], "tokenizer", "tokenizer.json")
        assert result["cache"].startswith(str(tmp_path)) and os.path.getsize(tokenizer_json) > 1000
        with open(tokenizer_json, "w") as f:  # for the second round
            f.write("{ not json")
    assert gguf_cache_dir(resolve_model_path("default")) != result["cache"]


def _variant_folder(tmp_path, name, edit_config, special_tokens_map=None):
    """A copy of the converted tokenizer folder with its tokenizer_config.json edited."""
    import shutil

    src = tokenizer_folder(resolve_model_path("default"))
    dst = tmp_path / name
    shutil.copytree(src, dst)
    config = json.loads((dst / "tokenizer_config.json").read_text())
    edit_config(config)
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    if special_tokens_map is not None:
        (dst / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    return str(dst)


@pytest.mark.parametrize("variant", ["bos_eos", "legacy_map", "no_chat_template_file"])
def test_config_variants_match_transformers(tmp_path, variant):
    """A config with add_bos_token/add_eos_token (transformers 5 keeps tokenizer.json's
    post-processor, so must we); special tokens only in the legacy
    special_tokens_map.json (as AddedToken dicts) plus an extra one missing from the
    vocabulary; the chat template in the config instead of chat_template.jinja."""
    from transformers import AutoTokenizer

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"

    def edit(config):
        if variant == "bos_eos":
            config.update(add_bos_token=True, add_eos_token=True)
        elif variant == "legacy_map":
            for name in ("bos_token", "eos_token", "pad_token"):
                config.pop(name, None)
        else:
            config["chat_template"] = template

    stmap = {"bos_token": {"content": "<|im_start|>", "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False}, "eos_token": "<|endoftext|>",
             "additional_special_tokens": ["<|my_tool|>"]} if variant == "legacy_map" else None
    folder = _variant_folder(tmp_path, variant, edit, stmap)
    if variant == "no_chat_template_file":
        os.remove(os.path.join(folder, "chat_template.jinja"))
    ours, hf = Tokenizer.from_folder(folder), AutoTokenizer.from_pretrained(folder)
    assert ours.special_tokens_map == hf.special_tokens_map and len(ours) == len(hf)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id)
    for text in CORPUS + ["call <|my_tool|> now"]:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), (variant, text[:40])
            assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    for conv in CONVERSATIONS:
        same_template_output(ours, hf, conv, tokenize=False, add_generation_prompt=True)
    if variant == "no_chat_template_file":
        assert ours.chat_template == template


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenization_matches(pairs, skip):
    """The server streams with IncrementalDetokenizer over this tokenizer: token by token it
    yields what it yields over the transformers tokenizer."""
    from lmprog_runtime.detokenize import IncrementalDetokenizer

    ours, hf = pairs["converted"]
    for text in CORPUS[6:14]:
        ids = hf.encode(text)
        a = IncrementalDetokenizer(ours, skip_special_tokens=skip, spaces_between_special_tokens=True)
        b = IncrementalDetokenizer(hf, skip_special_tokens=skip, spaces_between_special_tokens=True)
        for n in range(1, len(ids) + 1):
            assert a.update(ids[:n]) == b.update(ids[:n]), (text, n)
