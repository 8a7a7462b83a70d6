"""HiCache through the Engine: a document workload several times larger than L1 gives the
same greedy tokens with HiCache on and off (evictions onto L2, load-backs, retraction, a
request failing while it holds a loaded-back prefix), every write policy keeps both tiers'
accounting exact, the `file` tier survives a restart (and namespaces stay apart), bad
configurations fail at start-up, and the tier metrics reach /metrics."""

import random

import pytest
import torch

from engine_helpers import make_engine
from lmprog_runtime.scheduler.faults import FaultInjector, Stage

GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0, "max_new_tokens": 60, "ignore_eos": True}
L1_TOKENS = 512  # about 1.7 documents
SHORT = [f"Request number {i} asks for a long story about the sea and" for i in range(8)]


def documents(n=6):
    return [f"Document {d}. " + " ".join(f"entry{d}x{i} holds value {i * 7 + d}." for i in range(28))
            for d in range(n)]


def workload(seed=0, n_docs=6, questions=3):
    docs = documents(n_docs)
    prompts = [f"{doc}\nQuestion {q}: what does entry{d}x{q} hold?" for d, doc in enumerate(docs)
               for q in range(questions)]
    random.Random(seed).shuffle(prompts)
    return prompts


def outputs(engine, prompts, params=GREEDY):
    """(output ids, their logprobs) per prompt, one request at a time. The tiny random model
    repeats one token, so the logprobs are what tells a wrong KV apart."""
    return [_summary(engine.generate(p, params, return_logprob=True)) for p in prompts]


def _summary(out):
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def assert_same(got, expected, tol=4e-6):
    """Same greedy tokens; logprobs within `tol` (cache on vs off differ by ~1e-6 in float32,
    a wrong prefix KV by far more)."""
    assert [ids for ids, _ in got] == [ids for ids, _ in expected]
    worst = max(abs(a - b) for (_, la), (_, lb) in zip(got, expected) for a, b in zip(la, lb))
    assert worst < tol, worst


@pytest.fixture(scope="module")
def reference(tiny_model_path):
    """(prompts, their greedy outputs, SHORT's long outputs, prompt sizes) without any cache."""
    prompts = workload()
    with make_engine(tiny_model_path, disable_radix_cache=True, max_total_tokens=16384) as eng:
        sizes = [eng.generate(p, {"max_new_tokens": 1})["meta_info"]["prompt_tokens"] for p in prompts]
        return prompts, outputs(eng, prompts), outputs(eng, SHORT, LONG), sizes


def test_the_working_set_is_several_times_l1(reference):
    sizes = reference[3]
    assert max(sizes) < L1_TOKENS  # each request fits alone
    assert sum(sizes) / 3 > 3 * L1_TOKENS  # the six documents do not fit, three times over


@pytest.mark.parametrize("config", [
    dict(),
    dict(hicache_io_backend="kernel"),  # layer-wise load-backs (the CPU default copies whole)
    dict(hicache_io_backend="kernel", force_overlap_schedule=True),
    dict(hicache_write_policy="write_through_selective"),
    dict(hicache_write_policy="write_back"),
    dict(page_size=4),
    dict(chunked_prefill_size=64, hicache_write_policy="write_through_selective"),  # chunks re-insert
    dict(hicache_ratio=2.5, schedule_policy="lpm"),  # L2 also evicts: 6 documents > L2
    dict(hicache_ratio=2.5, hicache_storage_backend="file"),  # ... and L3 prefetches them back
    dict(hicache_ratio=2.5, hicache_storage_backend="file", force_overlap_schedule=True,
         hicache_io_backend="kernel"),
    dict(hicache_ratio=2.5, hicache_storage_backend="file", hicache_storage_prefetch_policy="best_effort"),
    dict(hicache_ratio=2.5, hicache_storage_backend="file", hicache_storage_prefetch_policy="timeout"),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "write_through")
def test_hicache_on_matches_off(tiny_model_path, reference, config, tmp_path):
    prompts, expected = reference[:2]
    config = {"max_total_tokens": L1_TOKENS, "hicache_ratio": 8.0, **config}
    if "hicache_storage_backend" in config:
        config = {"hicache_storage_prefetch_policy": "wait_complete", **config,
                  "hicache_storage_dir": str(tmp_path),
                  "hicache_storage_backend_extra_config": '{"prefetch_threshold": 64}'}
    with make_engine(tiny_model_path, enable_hierarchical_cache=True, **config) as eng:
        assert_same(outputs(eng, prompts), expected)
        state = eng.get_internal_state()
        if "hicache_storage_backend" in config:
            assert state["hicache_prefetch_count"] > 0, state
            # L2 evicted documents into storage-only tree nodes, and prefetches filled them again
            assert state["hicache_storage_demoted_tokens"] > 0, state
            if config["hicache_storage_prefetch_policy"] == "wait_complete":
                assert state["hicache_storage_filled_tokens"] > 0, state
            if config["hicache_storage_prefetch_policy"] != "best_effort":  # (that one may stop at once)
                assert state["hicache_hit_tokens_l3"] > 0, state
        if config.get("hicache_write_policy") != "write_through_selective":  # (copies re-used nodes only)
            assert state["hicache_hit_tokens_l2"] > 0, state  # prefixes came back from the host
            assert state["l2_load_bytes"] > 0 and state["hicache_load_back_count"] > 0
            layerwise = config.get("hicache_io_backend") == "kernel"
            assert (state["hicache_layerwise_copy_seconds_sum"] > 0) == layerwise, state
        assert state["hicache_hit_tokens_l1"] > 0
        eng.check_integrity()  # both tiers: free + tree + held == total


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_retraction_with_hicache(tiny_model_path, reference, io_backend):
    expected_long = reference[2]
    with make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=256,
                     hicache_ratio=8.0, hicache_io_backend=io_backend) as eng:
        outs = eng.generate(SHORT, LONG, return_logprob=True)  # all at once: decode room runs out
        assert sum(o["meta_info"]["num_retractions"] for o in outs) > 0
        assert_same([_summary(o) for o in outs], expected_long)
        eng.check_integrity()


@pytest.mark.parametrize("io_backend", ["direct", "kernel"])
def test_failure_while_holding_a_loaded_back_prefix(tiny_model_path, reference, io_backend):
    """(With `kernel` the request fails while its layer-wise copy may still be in flight.)"""
    from lmprog_runtime.generate_request import RequestError

    prompts, expected = reference[:2]
    faults = FaultInjector()
    with make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=L1_TOKENS,
                     hicache_ratio=8.0, faults=faults, hicache_io_backend=io_backend) as eng:
        assert_same(outputs(eng, prompts), expected)  # every document now has a host copy
        victim = next(p for p in prompts if p.split("\n")[0] != prompts[-1].split("\n")[0])
        before = eng.get_internal_state()["hicache_load_back_count"]
        faults.arm(Stage.KV_ASSIGN, "victim")  # fires right after assign loaded the prefix back
        with pytest.raises(RequestError, match=r"Internal error in admission \(KV assign\)"):
            eng.generate(victim, GREEDY, rid="victim-0")
        assert ("admission (KV assign)", "victim-0") in [(s.value, r) for s, r in faults.fired]
        assert eng.get_internal_state()["hicache_load_back_count"] > before
        eng.check_integrity()
        assert_same(outputs(eng, prompts), expected)
        eng.check_integrity()


def test_file_tier_survives_a_restart_and_keeps_namespaces_apart(tiny_model_path, tmp_path, reference):
    prompts, expected = reference[:2]
    config = dict(enable_hierarchical_cache=True, max_total_tokens=L1_TOKENS, hicache_ratio=4.0,
                  hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                  hicache_storage_prefetch_policy="wait_complete",
                  hicache_storage_backend_extra_config='{"prefetch_threshold": 64}')
    with make_engine(tiny_model_path, **config) as eng:
        first = eng.generate(prompts[0], GREEDY, return_logprob=True)
        assert_same([_summary(first)], expected[:1])
        assert first["meta_info"]["cached_tokens"] == 0
        assert eng.get_internal_state()["l3_write_bytes"] > 0
    assert [p for p in tmp_path.iterdir() if p.name.endswith("_0_1.bin")]  # one file per page
    with make_engine(tiny_model_path, **config) as eng:  # restarted: empty L1 and L2, same directory
        salted = eng.generate(prompts[0], GREEDY, cache_salt="tenant-b", return_logprob=True)
        assert salted["meta_info"]["cached_tokens"] == 0  # another namespace: no key matches
        assert_same([_summary(salted)], expected[:1])
        out = eng.generate(prompts[0], GREEDY, return_logprob=True)
        assert out["meta_info"]["cached_tokens"] > 0  # served from the pages the first run wrote
        assert_same([_summary(out)], expected[:1])
        state = eng.get_internal_state()
        assert state["hicache_hit_tokens_l3"] > 0 and state["l3_read_bytes"] > 0
        assert state["hicache_prefetch_count"] >= 1
        eng.check_integrity()


def test_metrics_export_the_tiers(tiny_model_path, reference):
    from lmprog_runtime.server.metrics import ServerMetrics

    prompts = reference[0]
    with make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=L1_TOKENS,
                     hicache_ratio=8.0) as eng:
        outputs(eng, prompts[:8])
        text = ServerMetrics("tiny").render(eng.get_internal_state()).decode()
    for line in ('lmprog:hicache_hit_tokens{model_name="tiny",tier="L2"}',
                 'lmprog:hicache_bytes_loaded{model_name="tiny",tier="L2"}',
                 'lmprog:hicache_bytes_written{model_name="tiny",tier="L2"}',
                 'lmprog:hicache_load_back_decisions{decision="load",model_name="tiny"}',
                 'lmprog:hicache_copy_bytes_per_second{model_name="tiny",tier="L2"}',
                 'lmprog:hicache_prefill_tokens_per_second{model_name="tiny"}',
                 'lmprog:hicache_seconds_sum{model_name="tiny",op="load_back"}',
                 'lmprog:hicache_layerwise_copy_seconds{model_name="tiny"}',
                 'lmprog:hicache_storage_tree_tokens{model_name="tiny"}'):
        assert line in text, line


def test_bad_configurations_fail_at_start_up(tiny_model_path, tmp_path):
    from lmprog_runtime.config import ServerArgs

    with pytest.raises(ValueError, match="must be larger than the device pool"):
        make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=L1_TOKENS,
                    hicache_size=0.0001)
    with pytest.raises(ValueError, match="hicache_ratio must be greater than 1"):
        ServerArgs(enable_hierarchical_cache=True, hicache_ratio=1.0)
    with pytest.raises(ValueError, match="needs enable_hierarchical_cache"):
        ServerArgs(hicache_storage_backend="file")
    with pytest.raises(ValueError, match="hicache_storage_backend must be one of"):
        ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="hf3fs")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ValueError, match="is not a writable directory"):
        make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=L1_TOKENS,
                    hicache_storage_backend="file", hicache_storage_dir=str(blocker / "pages"))
    with pytest.raises(ValueError, match="unknown key"):
        make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=L1_TOKENS,
                    hicache_storage_backend="file", hicache_storage_dir=str(tmp_path),
                    hicache_storage_backend_extra_config='{"prefetch_treshold": 1}')


def test_bfloat16_host_tier_stays_close(tiny_model_path, reference):
    """L2 in bfloat16 under a float32 pool: load-backs carry KV rounded once to bf16 (the
    conversion is unit-tested bit for bit in tests/cache); outputs stay close, not identical."""
    prompts, expected = reference[:2]
    with make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=L1_TOKENS,
                     hicache_ratio=8.0, hicache_host_dtype="bfloat16") as eng:
        got = outputs(eng, prompts)
        assert eng.get_internal_state()["hicache_hit_tokens_l2"] > 0
        eng.check_integrity()
    worst = max(abs(a - b) for (_, la), (_, lb) in zip(got, expected) for a, b in zip(la, lb))
    assert 0 < worst < 1e-2, worst  # > 0: the rounded copies were really used


def test_bfloat16_kv_pool_with_hicache(tiny_model_path):
    """--kv-cache-dtype bf16: the host tier takes the pool's dtype (auto), so a loaded-back
    prefix carries the very bf16 K/V the pool held: outputs as without any cache."""
    prompts = workload()
    with make_engine(tiny_model_path, disable_radix_cache=True, max_total_tokens=16384, kv_cache_dtype="bf16") as eng:
        expected = outputs(eng, prompts)
    with make_engine(tiny_model_path, enable_hierarchical_cache=True, max_total_tokens=L1_TOKENS,
                     hicache_ratio=8.0, kv_cache_dtype="bf16") as eng:
        got = outputs(eng, prompts)
        state = eng.get_internal_state()
        assert eng.scheduler.kv.hicache.io.host_pool.dtype == torch.bfloat16
        assert state["hicache_hit_tokens_l2"] > 0 and state["hicache_load_back_count"] > 0, state
        eng.check_integrity()
    assert_same(got, expected)
