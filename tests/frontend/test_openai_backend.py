"""The OpenAI-compatible backend with a recording fake client: requests sent, and clear refusals."""

import json
from types import SimpleNamespace as NS

import pytest

import lmprog as sgl
from lmprog.interpreter import ProgramError


class FakeClient:
    def __init__(self):
        self.calls = []
        self.chat = NS(completions=NS(create=self._chat))
        self.completions = NS(create=self._completion)

    def _usage(self):
        return NS(prompt_tokens=5, completion_tokens=2)

    def _chat(self, **kwargs):
        self.calls.append(("chat", kwargs))
        return NS(id="c1", usage=self._usage(),
                  choices=[NS(index=0, message=NS(content="Hello there"), finish_reason="stop")])

    def _completion(self, **kwargs):
        self.calls.append(("completion", kwargs))
        if kwargs.get("echo"):
            choices = []
            for i, prompt in enumerate(kwargs["prompt"]):
                head, choice = prompt[:-5], prompt[-5:]
                score = -0.1 if choice == " Rome" else -2.0
                choices.append(NS(index=i, finish_reason="length", text=prompt + "!", logprobs=NS(
                    tokens=[head, choice, "!"], token_logprobs=[None, score, -1.0])))
            return NS(id="e", usage=self._usage(), choices=choices)
        return NS(id="c2", usage=self._usage(), choices=[NS(index=0, text=" done", finish_reason="stop")])


def test_chat_model_sends_messages_and_constraints():
    client = FakeClient()
    backend = sgl.OpenAI("gpt-test", client=client)

    @sgl.function
    def prog(s):
        s += sgl.system("Be brief.") + sgl.user("Hi")
        s += sgl.assistant(sgl.gen("a", max_tokens=7, json_schema='{"type": "object"}', regex=None))

    state = prog.run(backend=backend, temperature=0)
    assert state["a"] == "Hello there"
    kind, kwargs = client.calls[0]
    assert kind == "chat" and kwargs["messages"] == [{"role": "system", "content": "Be brief."},
                                                      {"role": "user", "content": "Hi"}]
    assert kwargs["max_tokens"] == 7 and kwargs["temperature"] == 0
    assert kwargs["response_format"]["json_schema"]["schema"] == json.loads('{"type": "object"}')
    assert backend.token_usage.prompt_tokens == 5


def test_chat_model_refuses_what_the_api_cannot_do():
    backend = sgl.OpenAI("gpt-test", client=FakeClient())

    @sgl.function
    def mid_text_gen(s):
        s += sgl.user("Hi")
        s += "free text" + sgl.gen("a")

    with pytest.raises(ProgramError, match="right after the assistant role"):
        mid_text_gen.run(backend=backend)["a"]

    @sgl.function
    def chat_select(s):
        s += sgl.user("Hi") + sgl.assistant(sgl.select("c", ["a", "b"]))

    with pytest.raises(ProgramError, match="select.* not available on the OpenAI chat API"):
        chat_select.run(backend=backend)["c"]


def test_completion_model_text_regex_and_select():
    client = FakeClient()
    backend = sgl.OpenAI("gpt-3.5-turbo-instruct", client=client)

    @sgl.function
    def prog(s):
        s += "Capital:" + sgl.gen("a", regex="[a-z ]+", max_tokens=3)
        s += " Italy's:" + sgl.select("c", [" Rome", " Oslo"])

    state = prog.run(backend=backend)
    assert state["a"] == " done" and state["c"] == " Rome"
    (_, gen_kwargs), (_, select_kwargs) = client.calls
    assert gen_kwargs["prompt"] == "Capital:" and gen_kwargs["extra_body"] == {"regex": "[a-z ]+"}
    assert select_kwargs["echo"] is True and len(select_kwargs["prompt"]) == 2
    assert state.get_meta_info("c")["normalized_prompt_logprobs"] == [-0.1, -2.0]
