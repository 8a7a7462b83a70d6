"""`--incremental-streaming-output`: streamed chunks as deltas instead of cumulative.

By default every chunk of a stream carries the whole text, `output_ids` and output-side
logprob lists so far (SGLang's default). With the flag, each chunk carries only what is
new since the previous chunk of the same request (SGLang's semantics); what queued up
between two chunks arrives coalesced in one. Prompt-side fields are unchanged.
Also the stream's other small helpers: meta_info's speculative fields, and how much of a
partial text to hold back while a stop string may be starting.
"""

from __future__ import annotations

from typing import Dict, List

OUTPUT_LIST_KEYS = ("output_token_logprobs", "output_top_logprobs", "output_token_ids_logprobs")


class DeltaCursor:
    """What one streamed request has sent so far; `delta(chunk)` is the rest of `chunk`."""

    def __init__(self):
        self.text = ""
        self.num_ids = 0
        self.num_logprobs: Dict[str, int] = {}

    def delta(self, chunk: dict) -> dict:
        text = chunk["text"]
        # The text only grows while streaming; a final decode that differs from what was
        # sent (a stop regex matched inside sent text) cannot take it back, so sends nothing.
        new_text = text[len(self.text):] if text.startswith(self.text) else ""
        self.text += new_text
        ids = chunk["output_ids"]
        out = {**chunk, "text": new_text, "output_ids": ids[self.num_ids:]}
        self.num_ids = len(ids)
        meta = dict(chunk["meta_info"])
        for key in OUTPUT_LIST_KEYS:
            values = meta.get(key)
            if isinstance(values, list):
                meta[key] = values[self.num_logprobs.get(key, 0):]
                self.num_logprobs[key] = len(values)
        out["meta_info"] = meta
        return out


def spec_meta(verify_ct: int, draft_tokens: int, accepted: int) -> dict:
    """meta_info's speculative-decoding fields (SGLang's names): accept length = tokens a
    verify step produced (accepted drafts + the bonus token), averaged over verify steps."""
    return {"spec_verify_ct": verify_ct,
            "spec_accept_length": (accepted + verify_ct) / verify_ct if verify_ct else 0.0,
            "spec_accept_rate": accepted / draft_tokens if draft_tokens else 0.0,
            "spec_draft_tokens": draft_tokens, "spec_accepted_tokens": accepted}


def stop_prefix_len(text: str, stops: List[str]) -> int:
    """Length of the longest tail of `text` that could still grow into a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
