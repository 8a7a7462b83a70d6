"""Size limits that need the model's numbers: prompt length before tokenizing, and the
output room a request can ever get (context length and KV pool)."""

from __future__ import annotations

from typing import List, Sequence

from lmprog_runtime.server.validate import SchemaError


def check_prompt_size(rt, text, field: str = "text") -> None:
    """Reject a text prompt that cannot fit the context before spending time tokenizing it.

    Each token covers at most `rt.max_token_bytes` bytes of UTF-8, so a text of B bytes has
    at least B / max_token_bytes tokens; past the context length it can never be served."""
    if text is None:
        return
    texts = [text] if isinstance(text, str) else text
    limit = rt.tm.context_len * rt.max_token_bytes
    for i, t in enumerate(texts):
        if len(t) <= limit // 4:  # a character is at most 4 bytes: cannot be over
            continue
        size = len(t.encode("utf-8", "surrogatepass"))
        if size > limit:
            path = field if isinstance(text, str) else f"{field}[{i}]"
            raise SchemaError(path, f"a prompt of at most {rt.tm.context_len} tokens (context length)", t,
                              f"{len(t)} characters (at least {size // rt.max_token_bytes} tokens)")


def check_fanout(rt, prompts: int, n: int, field: str) -> None:
    """prompts x n requests in one call stay within --max-batch-size."""
    limit = rt.args.max_batch_size
    if prompts * n > limit:
        raise SchemaError(field, f"at most {limit} sequences per request (prompts x n, --max-batch-size)",
                          None, f"{prompts} prompt(s) x n={n}")


def output_room(rt, prompt_len: int) -> int:
    """The most tokens a request with a `prompt_len`-token prompt can ever generate here:
    the scheduler's own limits (sent in SchedulerReady), so both sides cut alike."""
    return rt.info["limits"].output_room(prompt_len)


def check_output_room(rt, job, explicit: Sequence[bool], clamp: Sequence[bool], field: str,
                      clamp_flag: str) -> None:
    """An explicitly asked max_new_tokens the server can never hold is a 400, unless the
    request asked to be clamped. `explicit`/`clamp` are per prompt (one entry = all)."""
    reqs: List = job.reqs
    per_prompt = max(1, len(reqs) // max(1, len(explicit)))
    for k, req in enumerate(reqs):
        i = min(k // per_prompt, len(explicit) - 1)
        room = output_room(rt, len(req.input_ids))
        asked = req.sampling_params.max_new_tokens
        if not explicit[i] or asked <= room:
            continue
        if clamp[i]:
            req.sampling_params.max_new_tokens = room
            continue
        raise SchemaError(field, f"at most {room} for a {len(req.input_ids)}-token prompt (context "
                                 f"{rt.info['context_len']} tokens, KV pool {rt.info['max_total_num_tokens']} "
                                 f"tokens; set {clamp_flag}: true to get that many)", asked)
