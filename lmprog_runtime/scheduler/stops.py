"""Stop detection after each new token: stop strings, stop regexes, stop tokens, EOS,
the length limit, and a grammar that has terminated. Decides, never acts: `check`
returns the reason or None.

Costs per step are bounded: stop strings decode the last `stop_str_max_len + 2` tokens;
stop regexes keep the output's text incrementally (`Req.detok`) and search its last
STOP_REGEX_WINDOW_CHARS characters, so a regex match longer than that is not seen."""

from __future__ import annotations

import re
from typing import Iterable, Optional

from lmprog_runtime.detokenize import IncrementalDetokenizer
from lmprog_runtime.messages import FinishReason

STOP_REGEX_WINDOW_CHARS = 8192


class StopChecker:
    def __init__(self, tokenizer, eos_token_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.eos = set(eos_token_ids)

    def check(self, r, token: int) -> Optional[FinishReason]:
        """Why `r` stops after appending `token` (its last output token), or None."""
        if len(r.output_ids) >= r.min_new_tokens:
            reason = self._stop_match(r, token)
            if reason is not None:
                return reason
        if len(r.output_ids) >= r.max_new_tokens:
            return FinishReason.length(r.max_new_tokens)
        if r.grammar is not None and r.grammar.is_terminated():
            # The grammar is complete without an EOS: the last token is content, not a stop token.
            return FinishReason.stop(None)
        return None

    def _stop_match(self, r, token: int) -> Optional[FinishReason]:
        sp = r.sampling
        if sp.stop_strs:
            window = r.output_ids[-(sp.stop_str_max_len + 2):]
            tail = self.tokenizer.decode(window, skip_special_tokens=sp.skip_special_tokens)
            for stop in sp.stop_strs:
                if stop in tail:
                    return FinishReason.stop(stop)
        if sp.stop_regex_strs:
            if r.detok is None:
                r.detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=sp.skip_special_tokens)
            text = r.detok.update(r.output_ids)[-STOP_REGEX_WINDOW_CHARS:]
            for pattern in sp.stop_regex_strs:
                if re.search(pattern, text):
                    return FinishReason.stop(pattern)
        if sp.stop_token_ids and token in sp.stop_token_ids:
            return FinishReason.stop(token)
        if token in self.eos and not sp.ignore_eos:
            return FinishReason.stop(token)
        return None
