"""`ProgramState` (the `s` a program appends to) and `ProgramStateGroup` (what `fork` returns)."""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from lmprog.interpreter import StreamExecutor
from lmprog.role_verbs import RoleVerbs
from lmprog.ir import ConcatAndAppend, ExprList, RoleBegin, RoleEnd


@dataclass(frozen=True, eq=False)
class SubmittedExprList(ExprList):
    """What `s.user("...")` returns: already submitted to `submitted_to`, so `s += it` adds nothing."""

    submitted_to: Any = None


class ProgramState(RoleVerbs):
    def __init__(self, stream_executor: StreamExecutor):
        self.stream_executor = stream_executor
        self.ret_value = None

    # --- appending ------------------------------------------------------------------------
    def __iadd__(self, other):
        if other is None:
            raise ValueError("Tried to append None to state.")
        if getattr(other, "submitted_to", None) is self.stream_executor:
            return self
        self.stream_executor.submit(other)
        return self

    def _role(self, role: str, expr=None):
        if expr is None:
            return self._role_block(role)
        expr = SubmittedExprList.concat(RoleBegin(role), expr, RoleEnd(role))
        submitted = SubmittedExprList(expr.exprs, submitted_to=self.stream_executor)
        self.stream_executor.submit(submitted)
        return submitted

    def _emit(self, expr) -> None:
        self.stream_executor.submit(expr)

    # --- forking --------------------------------------------------------------------------
    def fork(self, size: int = 1, position_ids_offset=None) -> "ProgramStateGroup":
        children = self.stream_executor.fork(size, position_ids_offset)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    @contextmanager
    def copy(self, position_ids_offset=None):
        group = self.fork(1, position_ids_offset)
        try:
            yield group[0]
        finally:
            group.join()

    # --- reading --------------------------------------------------------------------------
    def __getitem__(self, name):
        return self.get_var(name)

    def get_var(self, name):
        return self.stream_executor.get_var(name)

    def __setitem__(self, name, value):
        self.set_var(name, value)

    def set_var(self, name, value):
        self.stream_executor.set_var(name, value)

    def __contains__(self, name):
        """Whether `name` is defined or queued to be (never waits)."""
        return self.stream_executor.has_var(name)

    def get_meta_info(self, name, timeout: Optional[float] = None):
        return self.stream_executor.get_meta_info(name, timeout)

    def sync(self):
        self.stream_executor.sync()

    def text(self) -> str:
        self.sync()
        self.stream_executor.raise_if_error()
        return self.stream_executor.text_

    def messages(self) -> list:
        self.sync()
        self.stream_executor.raise_if_error()
        return self.stream_executor.messages_

    def error(self) -> Optional[BaseException]:
        """The recorded failure, or None. Never raises."""
        self.sync()
        return self.stream_executor.error_

    def __repr__(self):
        ex = self.stream_executor
        ex.sync()
        return f"ProgramState({ex.text_!r})"

    # --- streaming ------------------------------------------------------------------------
    def text_iter(self, var_name=None) -> Iterator[str]:
        for chunk, _ in self._chunks(var_name):
            yield chunk

    async def text_async_iter(self, var_name=None, return_meta_data: bool = False):
        """Async chunks; with `return_meta_data`, `(chunk, meta)` whose output logprobs are this chunk's."""
        loop = asyncio.get_running_loop()
        chunks, done = self._chunks(var_name), object()
        merged_meta, seen_logprobs = None, 0
        while True:
            item = await loop.run_in_executor(None, next, chunks, done)
            if item is done:
                break
            chunk, meta = item
            if not return_meta_data:
                if chunk:
                    yield chunk
                continue
            delta, seen_logprobs = _chunk_meta(meta, seen_logprobs)
            merged_meta = _merge_meta(merged_meta, delta)
            if chunk:
                yield chunk, merged_meta
                merged_meta = None

    def _chunks(self, var_name):
        ex = self.stream_executor
        if not ex.stream:
            yield (self.text() if var_name is None else self.get_var(var_name)), (
                None if var_name is None else ex.meta_info.get(var_name))
            return
        if var_name is None:
            yield from _text_chunks(ex)
        else:
            yield from _var_chunks(ex, var_name)


def _text_chunks(ex: StreamExecutor):
    pos = 0
    while True:
        new, pos, done = ex.wait_text(pos)
        if new:
            yield new, None
        if done:
            ex.raise_if_error()
            return


def _var_chunks(ex: StreamExecutor, name):
    index, yielded = 0, False
    while True:
        new, done, ready_value = ex.wait_stream(name, index)
        index += len(new)
        for chunk, meta in new:
            yielded = True
            yield chunk, meta
        if done and ex.streamed_count(name) == index:
            if not yielded and ready_value is not None:  # set without streaming (select, var scope)
                yield ready_value, ex.meta_info.get(name)
            if ready_value is None:
                ex.raise_if_error()
            return


def _chunk_meta(meta, seen: int):
    """This chunk's slice of cumulative output logprob lists."""
    if not meta:
        return meta, seen
    meta = dict(meta)
    total = seen
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        if isinstance(meta.get(key), list):
            total = len(meta[key])
            meta[key] = meta[key][seen:]
    return meta, total


def _merge_meta(acc, meta):
    if acc is None or meta is None:
        return meta if acc is None else acc
    merged = dict(meta)
    for key in ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs"):
        if isinstance(acc.get(key), list) and isinstance(meta.get(key), list):
            merged[key] = acc[key] + meta[key]
    return merged


class ProgramStateGroup:
    """The branches of a fork. `g[i]` is branch i; `g += x` appends to every branch."""

    def __init__(self, states, src_state: ProgramState):
        self.states = states
        self.src_state = src_state

    def __getitem__(self, i) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i, value):
        if value is not self.states[i]:
            raise ValueError("a fork branch can only be updated in place (forks[i] += ...).")

    def __len__(self):
        return len(self.states)

    def __iter__(self):
        return iter(self.states)

    def __iadd__(self, other):
        if callable(other):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"expected {len(self.states)} items, one per branch, got {len(other)}.")
            for state, item in zip(self.states, other):
                state += item
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable"):
        if mode == "gather_variable":
            self._gather()
        elif mode == "concate_and_append":
            parent = self.src_state
            parent += ConcatAndAppend(tuple(s.stream_executor for s in self.states))
            parent.sync()
            parent.stream_executor.raise_if_error()
        else:
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}.")

    def _gather(self):
        parent = self.src_state.stream_executor
        before = set(parent.variables)
        gathered = {}
        for state in self.states:
            child = state.stream_executor
            child.sync()
            child.raise_if_error()
            for name, value in child.variables.items():
                if name not in before:
                    gathered.setdefault(name, []).append(value)
        for name, values in gathered.items():
            parent.set_var(name, values)
        for state in self.states:
            state.stream_executor.end()
