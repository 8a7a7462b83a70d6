"""HiCache on the GPU (pinned host pool, device <-> host copies, load-back) against the CPU
reference: the same document workload, L1 several times too small, same greedy tokens and
logprobs within float tolerance; both tiers' audit exact. Skipped without CUDA."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from engine_helpers import make_engine  # noqa: E402

DOCS = [f"Document {d}. " + " ".join(f"entry{d}x{i} holds value {i * 7 + d}." for i in range(28)) for d in range(6)]
PROMPTS = [f"{doc}\nQuestion {q}: what?" for q in range(2) for doc in DOCS]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}


def run(eng):
    outs = [eng.generate(p, GREEDY, return_logprob=True) for p in PROMPTS]
    return [(o["output_ids"], [lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]]) for o in outs]


def test_hicache_on_gpu_matches_the_cpu(tiny_model_path, tmp_path):
    with make_engine(tiny_model_path, device="cpu", disable_radix_cache=True, max_total_tokens=16384) as eng:
        expected = run(eng)
    with make_engine(tiny_model_path, device="cuda", max_total_tokens=512, enable_hierarchical_cache=True,
                     hicache_ratio=8.0, hicache_storage_backend="file", hicache_storage_dir=str(tmp_path)) as eng:
        got = run(eng)
        state = eng.get_internal_state()
        assert state["hicache_hit_tokens_l2"] > 0 and state["l2_load_bytes"] > 0, state
        eng.check_integrity()
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    worst = max(abs(a - b) for (_, la), (_, lb) in zip(got, expected) for a, b in zip(la, lb))
    assert worst < 1e-3, worst
