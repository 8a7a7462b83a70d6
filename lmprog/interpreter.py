"""The stream executor: runs the expressions appended to one program state, in order.

Each state owns one executor. Its caller thread only enqueues expressions; a worker
thread (started on demand, gone when the queue is empty) executes them one at a
time and appends text. Readers wait on one condition variable for exactly what they
need: a variable (`get_var`), the whole queue (`sync`), or new streamed text.

Invariants:
- `text_` only grows by appends in the worker, except `separate_reasoning`, which rewrites the tail.
- `_pending_vars[name]` counts queued expressions that will (re)define `name`;
  `name` is ready when that count is 0.
- After an error, `error_` is set, queued work is skipped, and every waiter wakes; reading
  a value that was never produced raises `ProgramError`. Nothing ever waits forever
  on a dead worker: new submissions restart a worker, and an errored state skips them.
"""

from __future__ import annotations

import collections
import contextvars
import queue
import threading
import uuid
from typing import Any, Dict, Optional

from lmprog import reasoning
from lmprog.ir import (ArgumentRef, CommitLazy, ConcatAndAppend, ConstantText, Expr, ExprList, Gen, Image,
                       RoleBegin, RoleEnd, SamplingParams, Select, SeparateReasoning, VarScopeBegin,
                       VarScopeEnd, Variable, Video, as_expr)


class _ThreadCache:
    """Runs each task on an idle worker thread, or on a new one when none is idle: never
    queues a task behind another (a program state's worker may wait on other states),
    and saves a thread start (~1-2 ms on a busy host) per program state. Idle workers
    exit after `IDLE_S`."""

    IDLE_S = 30.0

    def __init__(self):
        self._lock = threading.Lock()
        self._idle: list = []  # the inboxes of idle workers

    def run(self, fn) -> None:
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._loop, args=(inbox,), name="lmprog-worker", daemon=True).start()
        inbox.put(fn)

    def _loop(self, inbox) -> None:
        while True:
            try:
                fn = inbox.get(timeout=self.IDLE_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # nobody handed us work meanwhile: retire
                        self._idle.remove(inbox)
                        return
                fn = inbox.get()  # a task is on its way
            try:
                fn()
            except BaseException:  # the executor records its own errors; never lose the thread silently
                import logging
                logging.getLogger(__name__).exception("lmprog worker task failed")
            with self._lock:
                self._idle.append(inbox)


_WORKERS = _ThreadCache()


class ProgramError(RuntimeError):
    """A model call (or the program itself) failed; raised where the user reads the result."""


class StreamExecutor:
    # The program state a fork inherits (copied: dicts and lists shallowly). Everything else
    # is configuration (passed to the child's constructor) or this executor's own machinery;
    # tests/frontend/test_interpreter.py checks that every attribute is one of the three.
    FORKED_STATE = ("variables", "meta_info", "text_", "messages_", "cur_role", "cur_role_begin_pos",
                    "images_", "cur_images", "_scope_start")
    CONFIG = ("backend", "arguments", "default_sampling_para", "chat_template", "stream", "use_thread")
    OWN = ("sid", "num_api_spec_tokens", "fork_start_text_pos", "error_", "stream_log", "_cond", "_queue",
           "_busy", "_pending_vars", "_program_finished")

    def __init__(self, backend, arguments: Dict[str, Any], default_sampling_para: SamplingParams,
                 chat_template=None, stream: bool = False, num_api_spec_tokens: Optional[int] = None,
                 use_thread: bool = True):
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.default_sampling_para = default_sampling_para
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens
        self.use_thread = use_thread

        self.variables: Dict[Any, Any] = {}
        self.meta_info: Dict[Any, Any] = {}
        self.text_ = ""
        self.messages_: list = []
        self.cur_role: Optional[str] = None
        self.cur_role_begin_pos: Optional[int] = None
        self.images_: list = []
        self.cur_images: list = []
        self.fork_start_text_pos: Optional[int] = None
        self.error_: Optional[BaseException] = None
        self.stream_log: Dict[Any, list] = {}  # var -> [(chunk, meta)], stream mode only

        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()
        self._busy = False
        self._pending_vars: collections.Counter = collections.Counter()
        self._scope_start: Dict[str, int] = {}
        self._program_finished = False

    # --- the caller's side -----------------------------------------------------------------
    def submit(self, expr) -> None:
        expr = as_expr(expr)
        with self._cond:
            for name in expr.named_outputs():
                self._pending_vars[name] += 1
            if not self.use_thread:
                self._busy = True
            else:
                self._queue.append(expr)
                if self._busy:
                    return
                self._busy = True
        if not self.use_thread:
            try:
                self._run_one(expr)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()
            return
        ctx = contextvars.copy_context()
        _WORKERS.run(lambda: ctx.run(self._worker))

    def sync(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: not self._busy)

    def get_var(self, name):
        with self._cond:
            self._cond.wait_for(lambda: self._pending_vars[name] == 0 or self.error_ is not None)
            if self._var_ready(name):
                return self.variables[name]
            if self.error_ is not None:
                raise self._program_error()
            raise KeyError(name)

    def get_meta_info(self, name, timeout: Optional[float] = None):
        with self._cond:
            ok = self._cond.wait_for(lambda: self._pending_vars[name] == 0 or self.error_ is not None, timeout)
            if not ok:
                raise TimeoutError(f"variable {name!r} was not ready after {timeout} s.")
            if name not in self.variables and self.error_ is not None:
                raise self._program_error()
            return self.meta_info.get(name)

    def set_var(self, name, value) -> None:
        with self._cond:
            self.variables[name] = value
            self._cond.notify_all()

    def raise_if_error(self) -> None:
        if self.error_ is not None:
            raise self._program_error()

    def record_error(self, error: BaseException) -> None:
        """Fail the state (the first error wins) and wake every waiter."""
        with self._cond:
            self.error_ = self.error_ or error
            self._cond.notify_all()

    def has_var(self, name) -> bool:
        """Whether `name` is defined or queued to be (never waits)."""
        with self._cond:
            return name in self.variables or self._pending_vars[name] > 0

    def wait_text(self, pos: int):
        """Block until the text grows past `pos` or the state ends: (text from `pos`, the
        text's length now, done)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.text_) > pos or self._ended())
            return self.text_[pos:], len(self.text_), self._ended()

    def wait_stream(self, name, index: int):
        """Block until variable `name` streams past chunk `index` or is ready or the state
        ends: (new [(chunk, meta)], done, the value if ready else None)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self.stream_log.get(name, ())) > index or self._var_ready(name)
                                or self._ended())
            new = list(self.stream_log.get(name, ()))[index:]
            ready = self._var_ready(name)
            return new, ready or self._ended(), self.variables.get(name) if ready else None

    def streamed_count(self, name) -> int:
        with self._cond:
            return len(self.stream_log.get(name, ()))

    def _ended(self) -> bool:  # caller holds `_cond`
        return self.is_finished() or self.error_ is not None

    def mark_program_finished(self) -> None:
        with self._cond:
            self._program_finished = True
            self._cond.notify_all()

    def is_finished(self) -> bool:
        """The program function returned and every queued expression ran (caller holds `_cond`)."""
        return self._program_finished and not self._busy

    def end(self) -> None:
        self.backend.end_program(self)

    def fork(self, size: int = 1, position_ids_offset=None):
        """`size` executors that continue from this state's text, variables and role."""
        self.sync()
        self.raise_if_error()
        if size > 1 and self.text_:
            self.submit(CommitLazy())  # the branches share this prefix: have the server cache it first
            self.sync()
            self.raise_if_error()
        children = []
        for _ in range(size):
            child = StreamExecutor(self.backend, self.arguments, self.default_sampling_para,
                                   self.chat_template, self.stream, use_thread=self.use_thread)
            for name in self.FORKED_STATE:
                value = getattr(self, name)
                setattr(child, name, value.copy() if isinstance(value, (dict, list)) else value)
            child.fork_start_text_pos = len(self.text_)
            self.backend.fork_program(self, child, position_ids_offset)
            children.append(child)
        return children

    # --- the worker's side -----------------------------------------------------------------
    def _worker(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._busy = False
                    self._cond.notify_all()
                    return
                expr = self._queue.popleft()
            self._run_one(expr)

    def _run_one(self, expr: Expr) -> None:
        if self.error_ is not None:
            return  # the state already failed; later work would build on a broken prefix
        try:
            self._execute(expr)
        except Exception as e:  # recorded, then raised to whoever reads the result
            with self._cond:
                self.error_ = e
                self._cond.notify_all()

    def _execute(self, expr) -> None:
        expr = as_expr(expr)
        handler = _HANDLERS.get(type(expr))
        if handler is None:
            handler = next((h for cls, h in _HANDLERS.items() if isinstance(expr, cls)), None)
        if handler is None:
            raise TypeError(f"cannot execute {type(expr).__name__} node {expr!r}.")
        handler(self, expr)

    def _var_ready(self, name) -> bool:
        return name in self.variables and self._pending_vars[name] == 0

    def _program_error(self) -> ProgramError:
        err = ProgramError(f"the program failed: {type(self.error_).__name__}: {self.error_}")
        err.__cause__ = self.error_
        return err

    def _append_text(self, text: str) -> None:
        with self._cond:
            self.text_ += text
            self._cond.notify_all()

    def _define(self, name, value, meta=None) -> None:
        with self._cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta
            self._pending_vars[name] -= 1
            self._cond.notify_all()

    def resolve_sampling_params(self, overlay: SamplingParams) -> SamplingParams:
        """Run defaults, then the gen's own fields, then template stops, then the dtype constraint."""
        return (self.default_sampling_para.merged(overlay)
                .with_extra_stops(self.chat_template.stop_str).constrained())

    # --- handlers (one per node type) ------------------------------------------------------
    def _execute_fill(self, expr: ConstantText) -> None:
        self._append_text(expr.value)

    def _execute_list(self, expr: ExprList) -> None:
        for child in expr.exprs:
            self._execute(child)

    def _execute_gen(self, expr: Gen) -> None:
        sp = self.resolve_sampling_params(expr.sampling_params)
        if not self.stream:
            comp, meta = self.backend.generate(self, sp)
            self._append_text(comp[0] if isinstance(comp, list) else comp)
            self._define(expr.name, comp, meta)
            return
        with self._cond:
            self.variables[expr.name] = ""
            log = self.stream_log[expr.name] = []
        meta = None
        for chunk, meta in self.backend.generate_stream(self, sp):
            with self._cond:
                self.text_ += chunk
                self.variables[expr.name] += chunk
                self.meta_info[expr.name] = meta
                log.append((chunk, meta))
                self._cond.notify_all()
        self._define(expr.name, self.variables[expr.name], meta)

    def _execute_select(self, expr: Select) -> None:
        decision = self.backend.select(self, list(expr.choices), expr.temperature, expr.choices_method)
        self._append_text(decision.decision)
        self._define(expr.name, decision.decision, decision.meta_info)

    def _execute_role_begin(self, expr: RoleBegin) -> None:
        if self.cur_role is not None:
            raise ValueError(f"Nested roles are not allowed: {expr.role!r} begins inside {self.cur_role!r}.")
        template = self.chat_template
        if not self.messages_ and expr.role != "system" and template.default_system_prompt:
            self._execute_role_begin(RoleBegin("system"))
            self._append_text(template.default_system_prompt)
            self._execute_role_end(RoleEnd("system"))
        self.cur_role = expr.role
        prefix, _ = template.get_prefix_and_suffix(expr.role, self.messages_)
        self._append_text(prefix)
        self.cur_role_begin_pos = len(self.text_)

    def _execute_role_end(self, expr: RoleEnd) -> None:
        if self.cur_role != expr.role:
            raise ValueError(f"Role {expr.role!r} ends, but the open role is {self.cur_role!r}.")
        content = self.text_[self.cur_role_begin_pos:].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(expr.role, self.messages_)
        self._append_text(suffix)
        self.messages_.append({"role": expr.role, "content": content})
        self.cur_role, self.cur_role_begin_pos = None, None

    def _execute_image(self, expr) -> None:
        if not self.backend.supports_images:
            raise NotImplementedError(
                f"{type(self.backend).__name__} does not accept image or video inputs: lmprog_runtime "
                "does not serve multimodal models yet. Remove sgl.image()/sgl.video() from the program.")
        self.images_.append(expr)
        self.cur_images.append(expr)
        self._append_text(self.chat_template.image_token)

    def _execute_variable(self, expr: Variable) -> None:
        self._append_text(str(expr.source.get_var(expr.name)))

    def _execute_var_scope_begin(self, expr: VarScopeBegin) -> None:
        self._scope_start[expr.name] = len(self.text_)

    def _execute_var_scope_end(self, expr: VarScopeEnd) -> None:
        self._define(expr.name, self.text_[self._scope_start.pop(expr.name):])

    def _execute_commit_lazy(self, expr: CommitLazy) -> None:
        if self.text_:
            self.backend.commit_lazy_operations(self)

    def _execute_concat_and_append(self, expr: ConcatAndAppend) -> None:
        # Text path: the branches' new text, in branch order. (No server offers a KV splice yet.)
        parts = []
        for child in expr.states:
            child.sync()
            child.raise_if_error()
            parts.append(child.text_[child.fork_start_text_pos:])
        self._append_text("".join(parts))

    def _execute_separate_reasoning(self, expr: SeparateReasoning) -> None:
        if self.stream:
            with self._cond:
                self._pending_vars[expr.name] -= 1
            return
        base = expr.name[: -len("_reasoning_content")]
        think, normal = reasoning.split(self.variables[base], expr.model_type)
        with self._cond:
            self.variables[base] = normal
            if self.cur_role_begin_pos is not None:
                self.text_ = self.text_[: self.cur_role_begin_pos] + normal
        self._define(expr.name, think)

    def _execute_argument(self, expr: ArgumentRef) -> None:
        raise TypeError(f"argument {expr.name!r} has no value: this graph was traced, not run.")


_HANDLERS = {
    ConstantText: StreamExecutor._execute_fill,
    ExprList: StreamExecutor._execute_list,
    Gen: StreamExecutor._execute_gen,
    Select: StreamExecutor._execute_select,
    RoleBegin: StreamExecutor._execute_role_begin,
    RoleEnd: StreamExecutor._execute_role_end,
    Image: StreamExecutor._execute_image,
    Video: StreamExecutor._execute_image,
    Variable: StreamExecutor._execute_variable,
    VarScopeBegin: StreamExecutor._execute_var_scope_begin,
    VarScopeEnd: StreamExecutor._execute_var_scope_end,
    CommitLazy: StreamExecutor._execute_commit_lazy,
    ConcatAndAppend: StreamExecutor._execute_concat_and_append,
    SeparateReasoning: StreamExecutor._execute_separate_reasoning,
    ArgumentRef: StreamExecutor._execute_argument,
}
