"""Sessions (SGLang's `/open_session`, `session_params`, `/close_session`).

A session remembers, for each finished request sent in it, its prompt and output tokens.
A new request with `session_params: {"id": S, "rid": R}` continues request R: its prompt
becomes R's prompt + R's output (+ only R's prompt with `drop_previous_output`), cut to
the first `offset` tokens when `offset` is given, followed by the new tokens (a leading
BOS of the new tokens is dropped). The client sends only the new turn; the radix cache
already holds the KV of R's whole sequence, so the continuation prefills only the new
tokens. `replace: true` forgets what followed R (or, without `rid`, the whole session).
Without `rid` a request starts a new branch from nothing.

The requests of a session form a tree: `rid -> (parent rid, token ids)`. Lives with the
TokenizerManager (the server side), so the HTTP server and the Engine share it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Dict, List, Optional

SESSION_PARAM_KEYS = ("id", "rid", "offset", "replace", "drop_previous_output")


class SessionError(ValueError):
    """A session request the runtime refuses (HTTP 400)."""


@dataclass
class _Node:
    parent: Optional[str]
    input_ids: List[int]
    output_ids: Optional[List[int]] = None  # None while the request runs
    children: List[str] = field(default_factory=list)


@dataclass
class Session:
    session_id: str
    capacity_of_str_len: int
    nodes: Dict[str, _Node] = field(default_factory=dict)

    def forget(self, rid: str) -> None:
        """Drop `rid` and everything that continued it."""
        node = self.nodes.pop(rid, None)
        if node is None:
            return
        for child in node.children:
            self.forget(child)

    def forget_children(self, rid: str) -> None:
        node = self.nodes[rid]
        for child in node.children:
            self.forget(child)
        node.children = []


class SessionStore:
    def __init__(self, bos_token_id: Optional[int] = None):
        self.bos_token_id = bos_token_id
        self.sessions: Dict[str, Session] = {}
        self._running: Dict[str, str] = {}  # rid of a running session request -> its session id

    def open(self, capacity_of_str_len: int, session_id: Optional[str] = None) -> str:
        session_id = session_id or uuid.uuid4().hex
        if session_id in self.sessions:
            raise SessionError(f"session_id: a session {session_id!r} is already open.")
        self.sessions[session_id] = Session(session_id, capacity_of_str_len)
        return session_id

    def close(self, session_id: str) -> None:
        if self.sessions.pop(session_id, None) is None:
            raise SessionError(f"session_id: no open session {session_id!r}.")

    def prompt(self, params: dict, input_ids: List[int]) -> List[int]:
        """The full prompt of a request continuing in session `params["id"]` (nothing changes
        until `begin`)."""
        session = self._session(params)
        parent_rid = params.get("rid")
        if parent_rid is None:
            return list(input_ids)
        parent = session.nodes.get(parent_rid)
        if parent is None:
            raise SessionError(f"session_params.rid: {parent_rid!r} is not a request of session "
                               f"{session.session_id!r}.")
        if parent.output_ids is None:
            raise SessionError(f"session_params.rid: request {parent_rid!r} has not finished yet.")
        if input_ids and input_ids[0] == self.bos_token_id:
            input_ids = input_ids[1:]
        prefix = parent.input_ids + ([] if params.get("drop_previous_output") else parent.output_ids)
        offset = params.get("offset")
        if offset:
            prefix = prefix[:offset]
        return prefix + list(input_ids)

    def begin(self, params: dict, rid: str, prompt: List[int]) -> None:
        """Register request `rid` (prompt from `prompt()`) in its session as it is submitted."""
        session = self._session(params)
        if rid in session.nodes:
            raise SessionError(f"rid: {rid!r} is already a request of session {session.session_id!r}.")
        parent_rid = params.get("rid")
        if parent_rid is not None and parent_rid not in session.nodes:  # forgotten meanwhile
            raise SessionError(f"session_params.rid: {parent_rid!r} is not a request of session "
                               f"{session.session_id!r}.")
        if params.get("replace"):
            if parent_rid is None:
                session.nodes.clear()
            else:
                session.forget_children(parent_rid)
        session.nodes[rid] = _Node(parent_rid, list(prompt))
        if parent_rid is not None:
            session.nodes[parent_rid].children.append(rid)
        self._running[rid] = session.session_id

    def _session(self, params: dict) -> Session:
        session = self.sessions.get(params.get("id"))
        if session is None:
            raise SessionError(f"session_params.id: no open session {params.get('id')!r} "
                               "(POST /open_session first).")
        return session

    def finish(self, rid: str, output_ids: List[int], failed: bool) -> None:
        """Record the output of a session request (a failed one is forgotten)."""
        session_id = self._running.pop(rid, None)
        session = self.sessions.get(session_id) if session_id is not None else None
        if session is None or rid not in session.nodes:
            return
        if failed:
            session.forget(rid)
        else:
            session.nodes[rid].output_ids = list(output_ids)
