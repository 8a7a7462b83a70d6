"""EBNF grammars: the `ebnf` sampling parameter, in SGLang's GBNF dialect.

    engine.generate(prompt, {"ebnf": 'root ::= "yes" | "no"', "max_new_tokens": 8})
    client.chat.completions.create(..., extra_body={"ebnf": 'root ::= ...'})       # OpenAI routes

Whatever `--grammar-backend` is, EBNF goes to xgrammar (a default dependency), through the
same mask and jump-forward path as regex and JSON schema: the text the grammar forces is
emitted without decoding it token by token.
"""

import openai
import pytest

CITY = 'root ::= "The capital is " city "."\ncity ::= "Paris" | "Rome" | "Oslo"'


def gen(engine, ebnf, max_new_tokens=24, **extra):
    return engine.generate("Answer:", {"ebnf": ebnf, "max_new_tokens": max_new_tokens, "temperature": 0, **extra})


def test_output_follows_the_grammar(tiny_engine):
    for _ in range(2):  # the second request hits the compiled-grammar cache
        out = gen(tiny_engine, CITY)
        assert out["text"] in ("The capital is Paris.", "The capital is Rome.", "The capital is Oslo.")
        assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_rules_repetition_and_character_classes(tiny_engine):
    grammar = 'root ::= item ("," item)*\nitem ::= [a-c] [0-9]'
    text = gen(tiny_engine, grammar, max_new_tokens=12)["text"]
    items = text.split(",")
    assert all(len(i) == 2 and i[0] in "abc" and i[1].isdigit() for i in items), text


def test_forced_text_is_jumped_over(tiny_engine):
    before = tiny_engine.get_internal_state()["num_jump_forward_tokens"]
    gen(tiny_engine, CITY)
    assert tiny_engine.get_internal_state()["num_jump_forward_tokens"] > before  # "The capital is "


def test_a_bad_grammar_is_a_clear_error(tiny_engine):
    with pytest.raises(Exception, match="Failed to compile ebnf grammar") as excinfo:
        gen(tiny_engine, 'root ::= "unclosed')
    assert getattr(excinfo.value, "status", None) == 400


def test_ebnf_through_the_openai_api(live_server):
    client = openai.OpenAI(base_url=live_server + "/v1", api_key="unused", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Capital?"}],
                                       max_tokens=24, temperature=0, extra_body={"ebnf": CITY})
    assert r.choices[0].message.content.startswith("The capital is ")
    r = client.completions.create(model=model, prompt="Yes or no:", max_tokens=4, temperature=0,
                                  extra_body={"ebnf": 'root ::= "yes" | "no"'})
    assert r.choices[0].text in ("yes", "no")


def test_structural_tags_go_to_xgrammar_too(tiny_engine):
    """`structural_tag` (also OpenAI `response_format: {"type": "structural_tag", ...}`):
    xgrammar's tag format, or SGLang's legacy {"structures": [...], "triggers": [...]}."""
    import json

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    tag = {"format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
                      "content": {"type": "regex", "pattern": "(yes|no)"}}}
    out = tiny_engine.generate("Answer:", {"structural_tag": json.dumps(tag), "max_new_tokens": 16,
                                           "temperature": 0})
    assert out["text"] in ("<answer>yes</answer>", "<answer>no</answer>"), out["text"]
    legacy = {"structures": [{"begin": "<answer>", "schema": schema, "end": "</answer>"}],
              "triggers": ["<answer>"]}
    out = tiny_engine.generate("Answer:", {"structural_tag": json.dumps(legacy), "max_new_tokens": 8,
                                           "temperature": 0})
    assert out["meta_info"]["finish_reason"] is not None  # free text until a trigger: compiles and runs
