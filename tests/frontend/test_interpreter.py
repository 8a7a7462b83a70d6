"""The stream executor and program states, against the scripted backend."""

import asyncio
import threading
import time

import pytest

import lmprog as sgl
from lmprog.interpreter import ProgramError
from scripted_backend import ScriptedBackend


@pytest.fixture
def backend():
    return ScriptedBackend()


def gens(backend):
    return [p for p in backend.request_log if p["sampling_params"].get("max_new_tokens") != 0]


# --- what goes over the wire ------------------------------------------------------------------------

def test_sampling_resolution_and_payload(backend):
    @sgl.function
    def prog(s):
        s += "Hi" + sgl.gen("x", max_tokens=3, stop="X", return_logprob=True, top_logprobs_num=2)

    state = prog.run(max_new_tokens=9, stop=["Y"], temperature=0, backend=backend)
    assert state["x"] == " scripted answer"
    (payload,) = backend.request_log
    sp = payload["sampling_params"]
    assert sp["max_new_tokens"] == 3 and sp["stop"] == ["X", "<|im_end|>"] and sp["temperature"] == 0
    assert sp["skip_special_tokens"] is True and sp["spaces_between_special_tokens"] is True
    assert payload["return_logprob"] is True and payload["top_logprobs_num"] == 2
    assert "logprob_start_len" not in payload and "regex" not in sp
    assert state.get_meta_info("x")["prompt_tokens"] == 1


def test_gen_int_stops_and_json_schema_travel(backend):
    @sgl.function
    def prog(s):
        s += "n=" + sgl.gen_int("n", stop="END") + sgl.gen("j", json_schema='{"type": "object"}')

    state = prog.run(backend=backend)
    state["j"]  # wait for both calls: run() returns while the worker still runs
    first, second = backend.request_log
    assert first["sampling_params"]["stop"] == ["END", "<|im_end|>", " ", "\n"]
    assert second["sampling_params"]["json_schema"] == '{"type": "object"}'
    assert int(state["n"]) == 42


def test_unnamed_gen_is_stored_under_none(backend):
    @sgl.function
    def prog(s):
        s += "a" + sgl.gen(max_tokens=1)

    assert prog.run(backend=backend)[None] == " scripted"


def test_n_greater_than_one_returns_a_list(backend):
    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x", n=2)

    state = prog.run(backend=backend)
    assert state["x"] == [" scripted answer"] * 2 and state.text() == "a scripted answer"


# --- ordering and waiting --------------------------------------------------------------------------

def test_reading_a_variable_waits_for_that_variable_only():
    backend = ScriptedBackend(delay=0.3)

    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("first", max_tokens=1)
        s += "b" + sgl.gen("second", max_tokens=1)

    start = time.perf_counter()
    state = prog.run(backend=backend)
    assert time.perf_counter() - start < 0.2  # run() returns before the model answers
    state["first"]
    waited = time.perf_counter() - start
    assert 0.25 < waited < 0.55  # the second gen is still in flight
    state.text()
    assert time.perf_counter() - start >= 0.55


def test_appends_after_run_returned_still_execute(backend):
    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x", max_tokens=1)

    state = prog.run(backend=backend)
    state += "b" + sgl.gen("y", max_tokens=1)
    assert state.text() == "a scriptedb scripted" and state["y"] == " scripted"


def test_reused_name_waits_for_latest_value(backend):
    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x", max_tokens=1)
        s += "b" + sgl.gen("x", max_tokens=2)

    assert prog.run(backend=backend)["x"] == " scripted answer"


def test_unknown_variable_is_key_error_not_hang(backend):
    @sgl.function
    def prog(s):
        s += "a"

    state = prog.run(backend=backend)
    with pytest.raises(KeyError):
        state["missing"]
    assert "missing" not in state


def test_role_expr_submitted_once(backend):
    @sgl.function
    def prog(s):
        s += s.user("hello")  # SGLang would submit twice; lmprog recognizes the returned expression
        s.assistant("ok")

    state = prog.run(backend=backend)
    assert [m["content"] for m in state.messages()] == ["hello", "ok"]


def test_var_scope_and_set_var(backend):
    @sgl.function
    def prog(s):
        with s.var_scope("block"):
            s += "inside" + sgl.gen("g", max_tokens=1)
        s += "outside"

    state = prog.run(backend=backend)
    assert state["block"] == "inside scripted"
    state["extra"] = 5
    assert state["extra"] == 5 and "extra" in state


def test_variable_of_another_state_and_ret_value(backend):
    @sgl.function
    def expert(s):
        s += "Expert:" + sgl.gen("expert", max_tokens=1)
        s += " Ask the" + s["expert"] + "."
        return "done"

    state = expert.run(backend=backend)
    assert state.text() == "Expert: scripted Ask the scripted." and state.ret_value == "done"


# --- errors are recorded, then raised where results are read ----------------------------------------------

def test_model_error_is_raised_at_read_and_never_hangs():
    backend = ScriptedBackend(fail=lambda p: "boom" in str(p.get("text")))

    @sgl.function
    def prog(s):
        s += "ok" + sgl.gen("a", max_tokens=1)
        s += "boom" + sgl.gen("b", max_tokens=1)
        s += "after" + sgl.gen("c", max_tokens=1)

    state = prog.run(backend=backend)
    assert state["a"] == " scripted"  # produced before the failure: still readable
    for read in (lambda: state["b"], lambda: state["c"], state.text, state.messages,
                 lambda: state.get_meta_info("c")):
        with pytest.raises(ProgramError, match="scripted failure"):
            read()
    assert isinstance(state.error(), RuntimeError)
    state += "more" + sgl.gen("d")  # appending to a failed state neither hangs nor runs
    with pytest.raises(ProgramError):
        state["d"]
    assert len(backend.request_log) == 2  # ok, boom; nothing after the failure


def test_server_abort_is_an_error():
    class Aborting(ScriptedBackend):
        def _answer(self, prompt, payload):
            out = super()._answer(prompt, payload)
            out["meta_info"]["finish_reason"] = {"type": "abort", "message": "queue full"}
            return out

    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x")

    with pytest.raises(ProgramError, match="queue full"):
        prog.run(backend=Aborting())["x"]


def test_nested_roles_and_images_fail_clearly(backend):
    @sgl.function
    def nested(s):
        with s.user():
            s += sgl.assistant("x")

    with pytest.raises(ProgramError, match="Nested roles"):
        nested.run(backend=backend).text()

    @sgl.function
    def with_image(s):
        s += sgl.user(sgl.image("cat.png") + "What is this?")

    with pytest.raises(ProgramError, match="does not accept image"):
        with_image.run(backend=backend).text()


def test_no_backend_is_a_clear_error():
    @sgl.function
    def prog(s):
        s += "a"

    sgl.set_default_backend(None)
    with pytest.raises(ValueError, match="set_default_backend"):
        prog.run()


def test_first_parameter_must_be_s():
    with pytest.raises(TypeError, match="named 's'"):
        sgl.function(lambda state: None)


# --- roles and templates --------------------------------------------------------------------------------

def test_default_system_prompt_is_injected():
    jinja = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}{{ '<s>system\\nDefault.</s>' }}"
             "{% endif %}{{ '<s>' + m['role'] + '\\n' + m['content'] + '</s>' }}{% endfor %}"
             "{% if add_generation_prompt %}{{ '<s>assistant\\n' }}{% endif %}")
    backend = ScriptedBackend(model_info={"model_path": "x", "chat_template": jinja})

    @sgl.function
    def prog(s):
        s += sgl.user("hi") + sgl.assistant(sgl.gen("a", max_tokens=1))

    state = prog.run(backend=backend)
    assert state.messages()[0] == {"role": "system", "content": "Default."}
    assert state.text().startswith("<s>system\nDefault.</s><s>user\nhi</s><s>assistant\n")
    assert backend.request_log[0]["sampling_params"]["stop"] == ["</s>"]


def test_chat_template_override(backend):
    other = ScriptedBackend(chat_template_name="llama-3-instruct")
    assert other.get_chat_template().name == "llama-3-instruct"


# --- fork and join ---------------------------------------------------------------------------------

def test_fork_commits_prefix_then_branches_and_gathers(backend):
    @sgl.function
    def prog(s):
        s += "Shared prefix." + sgl.gen("pre", max_tokens=1)
        forks = s.fork(3)
        forks += [" one", " two", " three"]
        forks += sgl.gen("tip", max_tokens=1)
        forks.join()
        return [f.text() for f in forks]

    state = prog.run(backend=backend)
    assert state["tip"] == [" scripted"] * 3 and state["pre"] == " scripted"
    assert state.ret_value[1] == "Shared prefix. scripted two scripted"
    log = backend.request_log
    assert log[1] == {"text": "Shared prefix. scripted", "sampling_params": {"max_new_tokens": 0}}
    assert len(log) == 5


def test_fork_of_one_or_empty_text_sends_no_commit(backend):
    @sgl.function
    def prog(s):
        forks = s.fork(2)
        forks += "x"
        forks.join()
        with s.copy() as c:
            c += "y" + sgl.gen("z", max_tokens=1)

    state = prog.run(backend=backend)
    assert state["z"] == [" scripted"]  # copy() gathers, as in SGLang
    assert all(p["sampling_params"].get("max_new_tokens") != 0 for p in backend.request_log)


def test_join_modes(backend):
    @sgl.function
    def prog(s):
        s += "Facts:"
        forks = s.fork(2)
        forks += lambda i: f" f{i}"
        forks.join("concate_and_append")
        s += "!"

    assert prog.run(backend=backend).text() == "Facts: f0 f1!"

    @sgl.function
    def bad(s):
        s.fork(2).join("zip")

    with pytest.raises(ValueError, match="join mode"):
        bad.run(backend=backend)


def test_fork_of_failed_state_raises():
    backend = ScriptedBackend(fail=lambda p: True)

    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x")
        s.fork(2)

    with pytest.raises(ProgramError):
        prog.run(backend=backend)


# --- select -----------------------------------------------------------------------------------------

def test_select_window_and_unconditional_request():
    backend = ScriptedBackend(choice_scores={"Rome": -0.1, "Paris": -3.0})

    @sgl.function
    def prog(s, method):
        s += "The capital of Italy is" + sgl.select("c", [" Paris", " Rome"], choices_method=method)

    state = prog.run(method=sgl.token_length_normalized, backend=backend)
    assert state["c"] == " Rome"
    meta = state.get_meta_info("c")
    assert meta["normalized_prompt_logprobs"] == [-3.0, -0.1]
    assert [e[2] for e in meta["input_token_logprobs"][1]] == [" Rome"]  # the intact prompt token is dropped
    prefill, scoring = backend.request_log
    assert prefill == {"text": "The capital of Italy is", "sampling_params": {"max_new_tokens": 0}}
    assert scoring["logprob_start_len"] == 4  # one token before the choice: 5 prompt tokens

    backend.request_log.clear()
    prog.run(method=sgl.unconditional_likelihood_normalized, backend=backend).text()
    assert "input_ids" in backend.request_log[-1] and len(backend.request_log) == 3


def test_select_rejects_sampling(backend):
    @sgl.function
    def prog(s):
        s += "x" + sgl.select("c", ["a", "b"], temperature=0.7)

    with pytest.raises(ProgramError, match="temperature must be 0"):
        prog.run(backend=backend)["c"]


# --- run_batch, bind, streaming ------------------------------------------------------------------------

def test_run_batch_arguments_and_modes(backend):
    @sgl.function
    def prog(s, a, b="B"):
        s += a + b + sgl.gen("x", max_tokens=1)

    items = [{"a": "1"}, ("2",), ["3", "C"]]
    states = prog.run_batch(items, backend=backend, num_threads=2, progress_bar=True)
    assert [st.text() for st in states] == ["1B scripted", "2B scripted", "3C scripted"]
    assert items[0] == {"a": "1"}  # the caller's dicts are not mutated
    sequential = prog.run_batch(items, backend=backend, num_threads=1)
    assert [st["x"] for st in sequential] == [" scripted"] * 3
    gen_states = prog.run_batch(items, backend=backend, generator_style=True)
    assert [st.text() for st in gen_states] == ["1B scripted", "2B scripted", "3C scripted"]
    assert prog.run_batch([], backend=backend) == []
    with pytest.raises(TypeError, match="mismatch"):
        prog.run_batch([()], backend=backend)


@pytest.mark.parametrize("num_threads", [1, 2])
def test_run_batch_generator_style_shows_a_progress_bar(backend, capsys, num_threads):
    @sgl.function
    def prog(s, a):
        s += a + sgl.gen("x", max_tokens=1)

    states = prog.run_batch([{"a": "1"}, {"a": "2"}, {"a": "3"}], backend=backend, generator_style=True,
                            progress_bar=True, num_threads=num_threads)
    assert capsys.readouterr().err == ""  # a generator: nothing runs (and no bar) until iterated
    assert [st.text() for st in states] == ["1 scripted", "2 scripted", "3 scripted"]
    assert "3/3" in capsys.readouterr().err  # the bar counted every state it yielded


def test_run_batch_errors_stay_per_state():
    backend = ScriptedBackend(fail=lambda p: "bad" in str(p.get("text")))

    @sgl.function
    def prog(s, q):
        s += q + sgl.gen("x", max_tokens=1)

    good, bad = prog.run_batch([{"q": "good"}, {"q": "bad"}], backend=backend)
    assert good["x"] == " scripted"
    with pytest.raises(ProgramError):
        bad["x"]


def test_bind_overrides_and_keeps_spec_tokens(backend):
    @sgl.function(num_api_spec_tokens=8)
    def prog(s, a, b):
        s += a + b

    bound = prog.bind(b="!")
    assert bound.num_api_spec_tokens == 8
    assert bound.run(a="hi", backend=backend).text() == "hi!"
    with pytest.raises(TypeError, match="unknown arguments"):
        prog.bind(c=1)


def test_streaming_text_and_variable_iterators(backend):
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", max_tokens=4) + " end"

    state = prog.run(stream=True, backend=backend)
    assert "".join(state.text_iter()) == "Q: scripted answer end"
    state = prog.run(stream=True, backend=backend)
    assert list(state.text_iter("a")) == [" scripted", " answer"]
    assert backend.request_log[-1]["stream"] is True

    async def collect():
        st = prog.run(stream=True, backend=backend, return_logprob=True)
        return [item async for item in st.text_async_iter("a", return_meta_data=True)]

    items = asyncio.run(collect())
    assert [c for c, _ in items] == [" scripted", " answer"]
    assert [len(m["output_token_logprobs"]) for _, m in items] == [1, 1]


def test_streaming_program_error_surfaces_in_iterator(backend):
    @sgl.function
    def prog(s):
        s += "x"
        raise RuntimeError("user code failed")

    state = prog.run(stream=True, backend=backend)
    with pytest.raises(ProgramError, match="user code failed"):
        list(state.text_iter())


def test_non_stream_iterators_yield_once(backend):
    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", max_tokens=1)

    state = prog.run(backend=backend)
    assert list(state.text_iter()) == ["Q: scripted"] and list(state.text_iter("a")) == [" scripted"]


def test_use_thread_false_runs_inline(backend):
    @sgl.function
    def prog(s):
        s += "a" + sgl.gen("x", max_tokens=1)
        return threading.active_count()

    state = prog.run(backend=backend, use_thread=False)
    assert state.text() == "a scripted"


def test_separate_reasoning(backend):
    backend.responder = lambda prompt, params: "<think>hmm</think>Answer"

    @sgl.function
    def prog(s):
        s += sgl.user("q")
        s += sgl.assistant(sgl.separate_reasoning(sgl.gen("a"), model_type="deepseek-r1"))

    state = prog.run(backend=backend)
    assert state["a"] == "Answer" and state["a_reasoning_content"] == "hmm"


def test_api_helpers(backend):
    sgl.set_default_backend(backend)
    try:
        assert sgl.get_server_info() == {"version": "scripted"}
        assert sgl.flush_cache() is None
    finally:
        sgl.set_default_backend(None)
    assert sgl.flush_cache() is False and sgl.get_server_info() is None


def test_every_executor_attribute_is_classified_for_fork(backend):
    """The clone() pitfall: a new attribute must be declared forked state, configuration
    or the executor's own, so `fork` cannot silently drop it."""
    from lmprog.interpreter import StreamExecutor
    from lmprog.ir import SamplingParams

    ex = StreamExecutor(backend, {}, SamplingParams())
    declared = set(StreamExecutor.FORKED_STATE) | set(StreamExecutor.CONFIG) | set(StreamExecutor.OWN)
    assert set(vars(ex)) == declared


def test_fork_copies_the_whole_state_including_images_and_open_scopes(backend):
    from lmprog.interpreter import StreamExecutor
    from lmprog.ir import SamplingParams

    ex = StreamExecutor(backend, {}, SamplingParams())
    ex.submit(sgl.user_begin())
    ex.submit("Hi ")
    ex.sync()
    ex.cur_images.append("an image")
    ex._scope_start["v"] = 1  # a var scope opened before the fork
    (child,) = ex.fork(1)
    for name in StreamExecutor.FORKED_STATE:
        assert getattr(child, name) == getattr(ex, name), name
    child.variables["x"] = 1
    assert "x" not in ex.variables  # copies, not shared
    assert child.fork_start_text_pos == len(ex.text_)
