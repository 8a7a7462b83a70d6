"""Server-side cost of one streamed output, as a function of its length.

    python bench/bench_detokenize.py [--tokens 4000]

Feeds a TokenizerManager one scheduler delta per token (as a stream with interval 1
sees them) and builds the streamed chunk's text after each, the work the server's event
loop does per chunk. Reports total seconds for the first n/4, n/2 and n tokens: with
incremental detokenization the total grows linearly (the per-token cost is flat);
`full decode` is the previous approach, decoding the whole output for every chunk, for
comparison. Text only: the cumulative `output_ids` copy and the HTTP serialization are
not timed. Writes bench/results/detokenize.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

from lmprog_runtime.messages import BatchOutput, ReqOutput, TokenizedGenerateReq  # noqa: E402
from lmprog_runtime.sampling_params import SamplingParams  # noqa: E402
from lmprog_runtime.tokenizer_manager import ReqState, TokenizerManager  # noqa: E402

TEXT = ("The harbour woke slowly: gulls first, then the ropes, then the café's shutters — "
        "ç'est la vie, said the old man, counting 12 boats and 3 ☂ umbrellas. ")


def stream_cost(tm, tokenizer, ids, marks, incremental: bool) -> dict:
    """Seconds spent up to each token count in `marks`."""
    sp = SamplingParams(stop=["never appears"])
    sp.normalize(tokenizer)
    msg = TokenizedGenerateReq(rid="r", input_ids=[1], sampling_params=sp, stream=True)
    st = ReqState(msg)
    tm.states["r"] = st
    out, t0 = {}, time.perf_counter()
    for n, tok in enumerate(ids, 1):
        tm.handle_output(BatchOutput([ReqOutput(rid="r", output_offset=n - 1, output_ids=[tok],
                                                finished_reason=None, prompt_tokens=1,
                                                completion_tokens=n, cached_tokens=0)]))
        if incremental:
            tm.output_text(st, partial=True)
        else:
            tokenizer.decode(st.output_ids, skip_special_tokens=True).rstrip("\ufffd")
        if n in marks:
            out[n] = time.perf_counter() - t0
    del tm.states["r"]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4000)
    args = ap.parse_args()
    from lmprog_runtime.tokenizer import load_tokenizer
    tokenizer = load_tokenizer("default")  # the server process's tokenizer (torch-free)
    ids = tokenizer.encode(TEXT * (args.tokens // 20 + 1))[:args.tokens]
    marks = (args.tokens // 4, args.tokens // 2, args.tokens)
    tm = TokenizerManager(tokenizer, len(tokenizer), 1 << 20, send=lambda m: None)
    result = {"tokens": args.tokens}
    for name, inc in (("incremental", True), ("full decode", False)):
        cost = stream_cost(tm, tokenizer, ids, marks, inc)
        result[name] = {str(k): v for k, v in cost.items()}
        parts = ", ".join(f"{m} tok {cost[m]:.3f} s" for m in marks)
        print(f"{name:12s}: {parts} (x{cost[marks[2]] / cost[marks[1]]:.2f} for twice the tokens; linear = 2)")
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "detokenize.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
