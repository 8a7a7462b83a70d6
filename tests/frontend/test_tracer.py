"""Tracing: graphs, placeholders, constant-prefix extraction, and the run_batch warm-up."""

import pytest

import lmprog as sgl
from lmprog import ir
from lmprog.tracer import extract_prefix_by_tracing
from scripted_backend import ScriptedBackend


@pytest.fixture
def backend():
    return ScriptedBackend()


def test_trace_records_graph(backend):
    @sgl.function
    def few_shot(s, question):
        s += "Q: 1+1?\nA: 2\n"
        s += "Q: " + question + "\n"
        s += "A:" + sgl.gen("answer", stop="\n")
        s += sgl.select(choices=["x", "y"])

    tracer = few_shot.trace(backend=backend)
    kinds = [type(n).__name__ for n in tracer.nodes]
    assert kinds == ["ConstantText", "ConstantText", "ArgumentRef", "ConstantText", "ConstantText", "Gen",
                     "Select"]
    assert set(tracer.variables) == {"answer", "select_0"}
    graph = tracer.last_node.print_graph_dfs()
    assert graph.count("\n") == len(tracer.nodes) - 1 and "Gen('answer')" in graph
    assert backend.request_log == []  # tracing never calls the model


def test_fstring_on_argument_raises(backend):
    @sgl.function
    def bad(s, name):
        s += f"Hello {name}"

    with pytest.raises(TypeError, match="f-string"):
        bad.trace(backend=backend)


def test_trace_of_fork_and_var_reads(backend):
    @sgl.function
    def prog(s):
        s += "Tips:" + sgl.gen("skeleton")
        forks = s.fork(2)
        forks += lambda i: "Tip " + str(i) + ":" + sgl.gen("tip")
        forks.join()
        s += "Summary of " + s["skeleton"]

    tracer = prog.trace(backend=backend)
    assert len(tracer.child_states) == 2
    child_kinds = [type(n).__name__ for n in tracer.child_states[0].nodes]
    assert child_kinds == ["ConstantText", "Gen"]
    assert isinstance(tracer.nodes[-1], ir.Variable)
    assert "Fork" in tracer.child_states[1].last_node.print_graph_dfs()


def test_prefix_includes_roles_and_bound_arguments(backend):
    @sgl.function
    def prog(s, system_prompt, question):
        s += sgl.system(system_prompt)
        with s.user():
            s += "Question: " + question
        s += sgl.assistant(sgl.gen("answer"))

    assert extract_prefix_by_tracing(prog, backend) == "<|im_start|>system\n"
    bound = prog.bind(system_prompt="Be brief.")
    assert extract_prefix_by_tracing(bound, backend) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQuestion: ")


def test_prefix_stops_at_inspection(backend):
    @sgl.function
    def prog(s, flag):
        s += "Constant part. " * 10
        if flag:
            s += "yes"

    assert extract_prefix_by_tracing(prog, backend) == "Constant part. " * 10


def test_run_batch_warms_prefix_once_and_only_when_long(backend):
    @sgl.function
    def prog(s, q):
        s += "A long constant instruction that every program in the batch shares. " * 2
        s += q + sgl.gen("a", max_tokens=2)

    prog.run_batch([{"q": "x"}, {"q": "y"}, {"q": "z"}], backend=backend)
    warm = [p for p in backend.request_log if p["sampling_params"] == {"max_new_tokens": 0}]
    assert len(warm) == 1 and backend.request_log[0] is warm[0]

    @sgl.function
    def short(s, q):
        s += "Short. " + q + sgl.gen("a", max_tokens=2)

    backend.request_log.clear()
    short.run_batch([{"q": "x"}, {"q": "y"}], backend=backend)
    assert not [p for p in backend.request_log if p["sampling_params"] == {"max_new_tokens": 0}]


def test_nested_function_call_inside_trace_is_traced(backend):
    @sgl.function
    def inner(s, x):
        s += "inner" + sgl.gen("y")

    @sgl.function
    def outer(s):
        s += "outer"
        inner(x="1")

    tracer = outer.trace(backend=backend)
    assert backend.request_log == [] and [type(n).__name__ for n in tracer.nodes] == ["ConstantText"]
