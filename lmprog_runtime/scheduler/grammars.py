"""GrammarQueue: constrained requests wait here while their grammar compiles.

The backend is built on the first constrained request (indexing the vocabulary costs
seconds). `poll` hands back what it decided: requests ready to wait for admission, and
requests that failed (with the reason); the scheduler moves them.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Callable, List, Optional, Tuple

from lmprog_runtime.messages import FinishReason

logger = logging.getLogger(__name__)

NO_BACKEND = ("Grammar-based generation (json_schema, regex, ebnf, structural_tag) is not "
              "supported when the server is launched with --grammar-backend none")


class GrammarQueue:
    def __init__(self, factory: Optional[Callable[[], object]], compile_timeout_s: float):
        self.factory = factory  # () -> grammar backend; None: --grammar-backend none
        self.backend = None
        self.compile_timeout_s = compile_timeout_s
        self.waiting: List = []

    def __len__(self) -> int:
        return len(self.waiting)

    def submit(self, req) -> Optional[FinishReason]:
        """Start compiling `req`'s grammar; an error reason if that cannot start."""
        if self.backend is None and self.factory is not None:
            try:
                self.backend = self.factory()
            except Exception as e:
                logger.exception("grammar backend failed to start")
                return FinishReason.error(500, f"The grammar backend could not start: {e}", "BadRequest")
        if self.backend is None:
            return FinishReason.error(400, NO_BACKEND, "BadRequest")
        req.grammar_future = self.backend.get_future(*req.sampling.grammar)
        req.grammar_wait_start = time.monotonic()
        self.waiting.append(req)
        return None

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for a pending compile to end. A scheduler with nothing
        else to do waits here instead of spinning: a Python loop polling the futures held the
        GIL against the compile threads, whose every release of it (a C call, a numpy op) then
        waited up to the 5 ms switch interval: a 20 ms compile took seconds."""
        futures = [r.grammar_future for r in self.waiting]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def poll(self) -> Tuple[List, List[Tuple[object, FinishReason]]]:
        """(ready requests, [(failed request, reason)]), in arrival order."""
        ready, failed, still = [], [], []
        for r in self.waiting:
            fut = r.grammar_future
            if not fut.done():
                if time.monotonic() - r.grammar_wait_start > self.compile_timeout_s:
                    fut.cancel()
                    failed.append((r, FinishReason.error(400, "Grammar preprocessing timed out", "BadRequest")))
                else:
                    still.append(r)
                continue
            try:
                r.grammar = fut.result()
            except Exception as e:  # compile failure → 400 naming the problem
                failed.append((r, FinishReason.error(400, str(e), "BadRequest")))
                continue
            r.grammar_future = None
            ready.append(r)
        self.waiting = still
        return ready, failed

    def remove_matching(self, hit: Callable) -> List:
        gone = [r for r in self.waiting if hit(r)]
        self.waiting = [r for r in self.waiting if not hit(r)]
        return gone
