"""The shared library of lmprog programs, each with the structural checks it must pass.

Every `check_*(backend)` runs one program and asserts what holds for any model,
including a tiny model with random weights: variables exist, roles are in order,
constraints are honoured (regex fullmatch, JSON validates, numbers parse), and the
prefix-sharing hints reach the runtime (when the backend records its requests).
The same functions run against the scripted backend, a live server and the Engine.
"""

from __future__ import annotations

import asyncio
import json
import re

import lmprog as sgl
from lmprog.backends.native import NativeBackend

IPV4_REGEX = r"((25[0-5]|2[0-4]\d|[01]?\d\d?)\.){3}(25[0-5]|2[0-4]\d|[01]?\d\d?)"
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "active": {"type": "boolean"},
    },
    "required": ["name", "color", "active"],
    "additionalProperties": False,
}
FEW_SHOT_PREFIX = ("The following are questions with answers.\n"
                   "Q: What is the capital of France?\nA: Paris\n"
                   "Q: What is the capital of Germany?\nA: Berlin\n"
                   "Q: What is the capital of Italy?\nA: Rome\n")


def _log(backend):
    """The backend's request log, reset; None for backends that do not record requests."""
    if not isinstance(backend, NativeBackend):
        return None
    backend.request_log = []
    return backend.request_log


def _is_prefill(payload) -> bool:
    return payload.get("sampling_params", {}).get("max_new_tokens") == 0


# --- few-shot QA ---------------------------------------------------------------------------------

@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT_PREFIX
    s += "Q: " + question + "\n"
    s += "A:" + sgl.gen("answer", stop="\n", temperature=0, max_tokens=16)


def check_few_shot_qa(backend):
    state = few_shot_qa.run(question="What is the capital of the United States?", backend=backend)
    answer = state["answer"]
    assert isinstance(answer, str) and "\n" not in answer
    assert state.text().endswith("A:" + answer)
    assert state.get_meta_info("answer")["completion_tokens"] <= 16

    log = _log(backend)
    questions = ["Capital of Japan?", "Capital of the UK?", "Capital of China?"]
    states = few_shot_qa.run_batch([{"question": q} for q in questions], backend=backend, temperature=0.1,
                                   progress_bar=False)
    assert [s.text().split("Q: ")[-1].split("\n")[0] for s in states] == questions
    assert all(isinstance(s["answer"], str) for s in states)
    if log is not None:  # the traced constant prefix went out once, as a zero-token request, first
        warm = [p for p in log if _is_prefill(p) and p["text"].startswith(FEW_SHOT_PREFIX)]
        assert len(warm) == 1 and log[0] is warm[0]
    return states


# --- multi-turn chat -----------------------------------------------------------------------------

@sgl.function
def multi_turn_chat(s, question_1, question_2):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=16))
    with s.user():
        s += question_2
    with s.assistant():
        s += sgl.gen("answer_2", max_tokens=16)


def check_multi_turn_chat(backend):
    state = multi_turn_chat.run(question_1="Name a fruit.", question_2="Name another.", backend=backend,
                                temperature=0)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[1]["content"] == "Name a fruit." and messages[3]["content"] == "Name another."
    assert messages[2]["content"] == state["answer_1"].strip()
    assert messages[4]["content"] == state["answer_2"].strip()
    template = backend.get_chat_template()
    user_prefix, user_suffix = template.role_prefix_and_suffix["user"]
    assert user_prefix + "Name a fruit." + user_suffix in state.text()
    return state


# --- select --------------------------------------------------------------------------------------

@sgl.function
def true_false(s, statement):
    s += "Decide whether each statement is true, false or unknown.\n"
    s += "Statement: The sky is blue.\nAnswer: True\n"
    s += "Statement: " + statement + "\nAnswer:"
    s += sgl.select("answer", [" True", " False", " Unknown"])


def check_select(backend, choices_method=None):
    log = _log(backend)
    program = true_false
    if choices_method is not None:
        @sgl.function
        def program(s, statement):
            s += "Statement: " + statement + "\nAnswer:"
            s += sgl.select("answer", [" True", " False", " Unknown"], choices_method=choices_method)
    state = program.run(statement="Fish can fly.", backend=backend)
    assert state["answer"] in (" True", " False", " Unknown")
    assert state.text().endswith("Answer:" + state["answer"])
    meta = state.get_meta_info("answer")
    assert len(meta["normalized_prompt_logprobs"]) == 3
    if log is not None:  # one prefill of the shared context, then one batched scoring request
        prefill, scoring = log[0], log[1]
        assert _is_prefill(prefill) and not prefill.get("return_logprob")
        assert isinstance(scoring["text"], list) and len(scoring["text"]) == 3
        assert all(t.startswith(prefill["text"]) for t in scoring["text"])
        assert scoring["return_logprob"] is True and _is_prefill(scoring)
    return state


# --- regex and JSON extraction ---------------------------------------------------------------------

@sgl.function
def ip_address(s):
    s += "Q: What is the IP address of the Google DNS servers?\nA: "
    s += sgl.gen("answer", temperature=0, regex=IPV4_REGEX, max_tokens=32)


def check_regex(backend):
    log = _log(backend)
    state = ip_address.run(backend=backend)
    assert re.fullmatch(IPV4_REGEX, state["answer"]), state["answer"]
    if log is not None:
        assert log[-1]["sampling_params"]["regex"] == IPV4_REGEX
    return state


@sgl.function
def extract_person(s, sentence):
    s += "Extract the person as JSON.\nSentence: " + sentence + "\nJSON: "
    s += sgl.gen("person", max_tokens=96, temperature=0, json_schema=json.dumps(PERSON_SCHEMA))


def check_json_extraction(backend):
    import jsonschema

    log = _log(backend)
    state = extract_person.run(sentence="Ann, who likes red, is active.", backend=backend)
    person = json.loads(state["person"])
    jsonschema.validate(person, PERSON_SCHEMA)
    if log is not None:
        assert json.loads(log[-1]["sampling_params"]["json_schema"]) == PERSON_SCHEMA
    return state


# --- typed values --------------------------------------------------------------------------------

@sgl.function
def typed_values(s):
    s += "Hours in a day: " + sgl.gen_int("hours", max_tokens=8) + "\n"
    s += "Pi is about " + sgl.gen("pi", dtype=float, max_tokens=8) + "\n"
    s += "Is water wet? " + sgl.gen("wet", dtype=bool, max_tokens=4) + "\n"


def check_dtypes(backend):
    log = _log(backend)
    state = typed_values.run(backend=backend, temperature=0)
    int(state["hours"])
    float(state["pi"])
    assert state["wet"] in ("True", "False")
    if log is not None:
        gens = [p for p in log if not _is_prefill(p)]
        assert [p["sampling_params"]["regex"] for p in gens] == [sgl.ir.REGEX_INT, sgl.ir.REGEX_FLOAT,
                                                                 sgl.ir.REGEX_BOOL]
        assert " " in gens[0]["sampling_params"]["stop"] and "\n" in gens[0]["sampling_params"]["stop"]
    return state


# --- tool use and a ReAct loop ------------------------------------------------------------------------

EXPRESSION_REGEX = r"[1-9][0-9]{0,2} [+*] [1-9][0-9]{0,2}"


@sgl.function
def tool_use(s, question):
    s += "Write a Python expression that answers the question.\n"
    s += "Question: " + question + "\nExpression: "
    s += sgl.gen("expression", regex=EXPRESSION_REGEX, max_tokens=16, temperature=0)
    result = eval(s["expression"], {"__builtins__": {}})  # the tool: a calculator
    with s.var_scope("answer"):
        s += str(result)
    return result


def check_tool_use(backend):
    state = tool_use(question="What is 257 times 983?", backend=backend)
    assert re.fullmatch(EXPRESSION_REGEX, state["expression"])
    assert int(state["answer"]) == state.ret_value
    return state


@sgl.function
def react(s, question, max_steps=3):
    s += "Answer the question using Search when needed.\nQuestion: " + question + "\n"
    for step in range(max_steps):
        s += f"Thought {step}:" + sgl.gen(f"thought_{step}", stop="\n", max_tokens=12) + "\n"
        s += f"Action {step}:" + sgl.select(f"action_{step}", [" Search", " Finish"]) + "\n"
        if s[f"action_{step}"] == " Finish":
            s += "Answer:" + sgl.gen("answer", stop="\n", max_tokens=12)
            return step
        s += f"Query {step}:" + sgl.gen(f"query_{step}", stop="\n", max_tokens=12) + "\n"
        s += f"Observation {step}: no results.\n"
    s += "Answer:" + sgl.gen("answer", stop="\n", max_tokens=12)
    return max_steps


def check_react(backend):
    state = react.run(question="Which country has more lakes, Finland or the United States?", backend=backend,
                      temperature=0)
    steps = state.ret_value
    assert "answer" in state and isinstance(state["answer"], str)
    for step in range(min(steps + 1, 3)):
        assert state[f"action_{step}"] in (" Search", " Finish")
        assert isinstance(state[f"thought_{step}"], str)
    return state


# --- parallel fork / join ------------------------------------------------------------------------------

@sgl.function
def parallel_tips(s, topic):
    s += "Give three short tips about " + topic + ".\n"
    for i in range(3):
        s += f"{i + 1}." + sgl.gen(f"tip_{i}", max_tokens=8, stop="\n") + "\n"
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Expand tip {i + 1}:" + sgl.gen("detail", 16, stop="\n\n")
    forks.join()
    s += "In summary:" + sgl.gen("summary", max_tokens=16)
    return [f["detail"] for f in forks]


def check_fork_join(backend):
    log = _log(backend)
    state = parallel_tips.run(topic="staying healthy", backend=backend, temperature=0)
    assert isinstance(state["summary"], str)
    details = state["detail"]
    assert isinstance(details, list) and len(details) == 3 and details == state.ret_value
    if log is not None:  # the shared prefix is committed before any branch request
        commit = next(i for i, p in enumerate(log) if _is_prefill(p))
        branches = [i for i, p in enumerate(log) if "Expand tip" in str(p.get("text"))]
        assert len(branches) == 3 and commit < min(branches)
        assert all(log[i]["text"].startswith(log[commit]["text"]) for i in branches)
    return state


@sgl.function
def parallel_encoding(s):
    s += "Facts:\n"
    forks = s.fork(2)
    forks += lambda i: ["Noah has a boat.\n", "The boat is red.\n"][i]
    forks.join(mode="concate_and_append")
    s += "Question: What color is the boat?\nAnswer:" + sgl.gen("answer", max_tokens=8, stop="\n")


def check_concat_and_append(backend):
    state = parallel_encoding.run(backend=backend, temperature=0)
    assert "Facts:\nNoah has a boat.\nThe boat is red.\nQuestion:" in state.text()
    assert isinstance(state["answer"], str)
    return state


# --- streaming -----------------------------------------------------------------------------------

@sgl.function
def streamed_qa(s, question):
    s += sgl.system("You are a helpful assistant.")
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", max_tokens=24, return_logprob=True))


def check_streaming(backend):
    state = streamed_qa.run(question="Tell me a story.", stream=True, backend=backend, temperature=0)
    pieces = list(state.text_iter())
    assert "".join(pieces) == state.text()

    state = streamed_qa.run(question="Tell me a story.", stream=True, backend=backend, temperature=0)
    answer = "".join(state.text_iter("answer"))
    assert answer == state["answer"]

    async def collect():
        st = streamed_qa.run(question="Again.", stream=True, backend=backend, temperature=0)
        chunks, logprob_count = [], 0
        async for chunk, meta in st.text_async_iter("answer", return_meta_data=True):
            assert chunk
            chunks.append(chunk)
            logprob_count += len(meta.get("output_token_logprobs") or [])
        return st, chunks, logprob_count

    st, chunks, logprob_count = asyncio.run(collect())
    assert "".join(chunks) == st["answer"]
    total = len(st.get_meta_info("answer")["output_token_logprobs"])
    # a trailing chunk that adds a token but no text (e.g. EOS) has no text to carry its logprob
    assert total - 1 <= logprob_count <= total
    return st


LIBRARY = {
    "few_shot_qa": check_few_shot_qa,
    "multi_turn_chat": check_multi_turn_chat,
    "select": check_select,
    "regex": check_regex,
    "json_extraction": check_json_extraction,
    "dtypes": check_dtypes,
    "tool_use": check_tool_use,
    "react": check_react,
    "fork_join": check_fork_join,
    "concat_and_append": check_concat_and_append,
    "streaming": check_streaming,
}
