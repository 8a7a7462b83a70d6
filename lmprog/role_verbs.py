"""The role and scope verbs of a program state (`s.user(...)`, `with s.system(): ...`,
`with s.var_scope(name): ...`), shared by the running state and the tracer's state.

A class using this mixin provides `_emit(expr)` (append one expression) and
`_role(role, expr)` (append a whole role, or return `_role_block(role)` when `expr` is None).
"""

from __future__ import annotations

from contextlib import contextmanager

from lmprog.ir import RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd


class RoleVerbs:
    def _emit(self, expr) -> None:
        raise NotImplementedError

    def _role(self, role: str, expr=None):
        raise NotImplementedError

    @contextmanager
    def _role_block(self, role: str):
        self._emit(RoleBegin(role))
        yield
        self._emit(RoleEnd(role))

    def system(self, expr=None):
        return self._role("system", expr)

    def user(self, expr=None):
        return self._role("user", expr)

    def assistant(self, expr=None):
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str):
        self._emit(VarScopeBegin(name))
        yield
        self._emit(VarScopeEnd(name))
