"""The real embedded model (SmolLM2-135M-Instruct) through prefill + decode Engines with the
KV over Mooncake: greedy tokens and logprobs identical to one colocated Engine, with a
chunked prompt: `pytest -m slow tests/disaggregation/test_pd_smollm2.py`."""

import pytest

from pd_helpers import audit, make_pair, merge, run_pair

pytestmark = pytest.mark.slow

PROMPT = ("Write a short paragraph about why lighthouses were painted with stripes, "
          "and mention one famous lighthouse. ") * 6
GREEDY = {"temperature": 0, "max_new_tokens": 24}


def test_smollm2_prefill_decode_matches_colocated():
    from engine_helpers import make_engine
    colocated = make_engine("default", max_total_tokens=4096, random_seed=0, num_threads=1)
    try:
        want = colocated.generate(PROMPT, GREEDY, return_logprob=True, logprob_start_len=0)
    finally:
        colocated.shutdown()
    prefill, decode, port = make_pair("default", "mooncake", chunked_prefill_size=64)
    try:
        p, d = run_pair(prefill, decode, port, PROMPT, GREEDY, return_logprob=True, logprob_start_len=0)
        got = merge(p, d)
        assert got["text"] == want["text"] and got["output_ids"] == want["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert got["meta_info"][key] == want["meta_info"][key], key
        audit(prefill, decode)
    finally:
        prefill.shutdown()
        decode.shutdown()
