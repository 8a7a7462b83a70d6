"""Tracing: run a program on placeholder arguments to see its graph without calling a model.

`trace()` records every node a program appends (with the fork structure);
`extract_prefix_by_tracing` keeps only the leading constant text, which `run_batch`
sends once as a zero-token request so that every program in the batch hits the
server's prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from lmprog.chat_template import ChatTemplate, get_chat_template
from lmprog.role_verbs import RoleVerbs
from lmprog.ir import (Argument, ConstantText, Expr, ExprList, Fork, Gen, GetForkItem, RoleBegin, RoleEnd,
                       Select, StopTracing, VarScopeBegin, VarScopeEnd, Variable, as_expr)


@dataclass(frozen=True, eq=False)
class TraceNode:
    """One traced node and the node before it (the graph is a tree of these)."""

    expr: Expr
    prev: Optional["TraceNode"]

    def print_graph_dfs(self) -> str:
        lines, node = [], self
        chain = []
        while node is not None:
            chain.append(node)
            node = node.prev
        for node in reversed(chain):
            prev = f"%{node.prev.expr.node_id} + " if node.prev is not None else ""
            lines.append(f"%{node.expr.node_id} = {prev}{node.expr!r}")
        text = "\n".join(lines)
        print(text)
        return text


class TracingScope:
    """A stack of active tracers; `@function` calls inside one are traced, not run."""

    cur_scope: Optional["TracingScope"] = None

    def __init__(self, tracer_state: "TracerProgramState"):
        self.tracer_state = tracer_state
        self.last_scope = None

    def __enter__(self):
        self.last_scope, TracingScope.cur_scope = TracingScope.cur_scope, self
        return self

    def __exit__(self, *exc):
        TracingScope.cur_scope = self.last_scope

    @classmethod
    def get_current_scope(cls):
        return cls.cur_scope


class TracerProgramState(RoleVerbs):
    """A stand-in `s` that records nodes instead of executing them."""

    def __init__(self, backend, arguments: Dict[str, Any], only_trace_prefix: bool,
                 chat_template: Optional[ChatTemplate] = None, last_node: Optional[TraceNode] = None):
        self.backend = backend
        self.arguments = arguments
        self.only_trace_prefix = only_trace_prefix
        self.chat_template = chat_template or (backend.get_chat_template() if backend is not None
                                               else get_chat_template("default"))
        self.nodes: List[Expr] = []
        self.last_node = last_node
        self.variables: Dict[str, Any] = {}
        self.messages_: List[dict] = []
        self.cur_role: Optional[str] = None
        self.child_states: List["TracerProgramState"] = []
        self.ret_value = None
        self._counts = {"gen": 0, "select": 0}

    # --- appending ------------------------------------------------------------------------
    def __iadd__(self, other):
        if other is None:
            raise ValueError("Tried to append None to state.")
        self._execute(other)
        return self

    def _append(self, expr: Expr) -> None:
        self.nodes.append(expr)
        self.last_node = TraceNode(expr, self.last_node)

    def _execute(self, other) -> None:
        if isinstance(other, Argument):
            if self.only_trace_prefix:
                raise StopTracing(f"argument {other.name!r} has no value")
            other = ExprList.concat(other + "")
        expr = as_expr(other)
        if isinstance(expr, ExprList):
            for child in expr.exprs:
                self._execute(child)
        elif isinstance(expr, (Gen, Select)):
            kind = "gen" if isinstance(expr, Gen) else "select"
            name = expr.name or f"{kind}_{self._counts[kind]}"
            self._counts[kind] += 1
            self.variables[name] = Variable(name, source=self)
            self._append(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeEnd):
            self.variables[expr.name] = Variable(expr.name, source=self)
            self._append(expr)
        elif isinstance(expr, (ConstantText, VarScopeBegin)) or not self.only_trace_prefix:
            self._append(expr)
        else:
            raise StopTracing(f"{type(expr).__name__} ends the constant prefix")

    def _role_begin(self, role: str) -> None:
        if not self.messages_ and role != "system" and self.chat_template.default_system_prompt:
            self._role_begin("system")
            self._append(ConstantText(self.chat_template.default_system_prompt))
            self._role_end("system")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self.cur_role = role
        self._append(ConstantText(prefix))

    def _role_end(self, role: str) -> None:
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._append(ConstantText(suffix))
        self.messages_.append({"role": role, "content": ""})
        self.cur_role = None

    # --- the rest of the `s` surface -------------------------------------------------------
    def _role(self, role, expr=None):
        if expr is None:
            return self._role_block(role)
        self._execute(ExprList.concat(RoleBegin(role), expr, RoleEnd(role)))
        return None

    def _emit(self, expr) -> None:
        self._execute(expr)

    def fork(self, size: int = 1, position_ids_offset=None):
        if self.only_trace_prefix:
            raise StopTracing("fork ends the constant prefix")
        fork_node = TraceNode(Fork(size), self.last_node)
        children = [TracerProgramState(self.backend, self.arguments, False, self.chat_template,
                                       last_node=TraceNode(GetForkItem(i), fork_node)) for i in range(size)]
        self.child_states.extend(children)
        return TracerForkGroup(children, self)

    def get_var(self, name):
        if name in self.arguments and not isinstance(self.arguments[name], Argument):
            return self.arguments[name]
        if self.only_trace_prefix:
            raise StopTracing(f"variable {name!r} is read")
        return self.variables.get(name, Variable(name, source=self))

    __getitem__ = get_var

    def set_var(self, name, value):
        self.variables[name] = value

    __setitem__ = set_var

    def __contains__(self, name):
        return name in self.variables

    def text(self):
        raise StopTracing("text() is read")

    def sync(self):
        pass

    def flatten_nodes(self) -> List[Expr]:
        return list(self.nodes)


class TracerForkGroup:
    """What `fork` returns while tracing: appends reach every branch; `join` records nothing."""

    def __init__(self, states, src_state):
        self.states, self.src_state = states, src_state

    def __getitem__(self, i):
        return self.states[i]

    def __setitem__(self, i, value):
        pass

    def __len__(self):
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other):
        for i, state in enumerate(self.states):
            state += other(i) if callable(other) else other[i] if isinstance(other, (list, tuple)) else other
        return self

    def join(self, mode: str = "gather_variable"):
        for state in self.states:
            for name, var in state.variables.items():
                self.src_state.variables.setdefault(name, var)


def _tracer_for(program, arguments: Dict[str, Any], backend, only_trace_prefix: bool):
    args = {name: Argument(name, None) for name in program.arg_names}
    args.update(arguments)
    args.update(program.bind_arguments)
    backend = getattr(backend, "endpoint", backend)  # an Engine or Runtime: its program backend
    return TracerProgramState(backend, args, only_trace_prefix), args


def trace_program(program, arguments: Dict[str, Any], backend, only_trace_prefix: bool = False):
    """Run `program.func` on a tracer; arguments not given become `Argument` placeholders."""
    tracer, args = _tracer_for(program, arguments, backend, only_trace_prefix)
    with TracingScope(tracer):
        tracer.ret_value = program.func(tracer, **args)
    return tracer


def extract_prefix_by_tracing(program, backend) -> str:
    """The constant text every run of `program` starts with ("" if none)."""
    tracer, args = _tracer_for(program, {}, backend, only_trace_prefix=True)
    try:
        with TracingScope(tracer):
            program.func(tracer, **args)
    except (StopTracing, TypeError, AttributeError, KeyError, ValueError):
        pass  # tracing stops where the program needs a value; the nodes so far still count
    prefix = []
    for node in tracer.nodes:
        if not isinstance(node, ConstantText):
            break
        prefix.append(node.value)
    return "".join(prefix)
