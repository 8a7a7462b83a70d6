"""`lmprog-runtime plan-kv`: the KV byte arithmetic against a hand computation for the tiny
model, the unit parsing, the disaggregation verdict flipping where the rule says, and the
command itself (given rates, a real calibration run, a real Mooncake TCP measurement)."""

import importlib.util
import json
import math

import pytest

from lmprog_runtime.plan_kv import (KVShape, Rates, decide, model_shape, parse_duration, parse_rate,
                                    transfer_seconds)
from lmprog_runtime.server.launch import build_parser, main


def _args(*argv):
    return build_parser().parse_args(["plan-kv", *argv])


def test_bytes_for_the_tiny_model_by_hand(tiny_model_path):
    # tiny Llama: 2 layers, 2 KV heads, head_dim 64 / 4 heads = 16, float32 weights:
    # 2 (K, V) x 2 x 2 x 16 x 4 bytes = 512 bytes per token
    shape, checkpoint = model_shape(_args("--model-path", tiny_model_path))
    assert (shape.num_layers, shape.num_kv_heads, shape.head_dim, shape.dtype) == (2, 2, 16, "float32")
    assert shape.bytes_per_token == 512 and checkpoint == "float32"
    paged, _ = model_shape(_args("--model-path", tiny_model_path, "--page-size", "4", "--dtype", "bfloat16"))
    assert paged.bytes_per_token == 256
    assert paged.transfer_bytes(10) == 3 * 4 * 256  # 10 tokens fill 3 pages of 4; whole pages move
    # 4 writes (K and V of 2 layers) x 10 us + 3072 bytes at 1 GB/s
    assert transfer_seconds(paged, 10, 1e9, 10e-6) == pytest.approx(4 * 10e-6 + 3072 / 1e9)


def test_units():
    assert parse_rate("25GB/s") == 25e9 and parse_rate("100Gb/s") == 12.5e9
    assert parse_rate("800MiB/s") == 800 * 2 ** 20 and parse_duration("10us") == pytest.approx(1e-5)
    assert parse_duration("0.5ms") == pytest.approx(5e-4) and parse_duration("3s") == 3
    for bad in ("25", "fast", "25GB"):
        with pytest.raises(ValueError, match="--link"):
            parse_rate(bad)
    with pytest.raises(ValueError, match="--latency"):
        parse_duration("10 parsecs")


def test_the_verdict_flips_where_the_rule_says():
    rates = Rates(prefill_s=1.0, decode_step_s=0.030, prefill_slowdown=2.0, decode_slowdown=1.2)
    quiet = decide(rates, arrival_rate=0.1, transfer_s=0.05)  # colocated ITL 33 ms < 36 ms
    assert not quiet.pays_off and "slower than colocated" in quiet.reason
    busy = decide(rates, arrival_rate=0.3, transfer_s=0.05)  # colocated ITL 43 ms > 36 ms; side at 60%
    assert busy.pays_off and busy.colocated_itl_s == pytest.approx(0.03 / 0.7)
    assert busy.disagg_ttft_s == pytest.approx(2.05) and busy.prefill_side_load == pytest.approx(0.6)
    flooded = decide(rates, arrival_rate=0.6, transfer_s=0.05)  # the prefill half cannot keep up
    assert not flooded.pays_off and "cannot keep up" in flooded.reason
    slow_link = decide(rates, arrival_rate=0.3, transfer_s=2.5)  # moving KV costs more than the prefill
    assert not slow_link.pays_off and "moving the KV" in slow_link.reason
    assert math.isinf(decide(rates, 1.5, 0.05).colocated_itl_s)


def test_cli_with_given_rates(tiny_model_path, capsys):
    argv = ["plan-kv", "--model-path", tiny_model_path, "--no-calibrate", "--prompt-tokens", "1000",
            "--prefill-tokens-per-s", "1000", "--decode-step-ms", "30", "--decode-slowdown", "1.2",
            "--arrival-rate", "0.3", "--link", "25GB/s", "--latency", "10us"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "KV per token: 512 bytes" in text and "custom" in text and "rdma-400g" in text
    assert main(argv + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["bytes_per_request_transferred"] == 512 * 1000
    custom = [r for r in plan["links"] if r["topology"] == "custom"][0]
    assert custom["transfer_s"] == pytest.approx(4 * 1e-5 + 512000 / 25e9)
    assert custom["verdict"]["pays_off"] is True
    assert main(argv[:-4] + ["--arrival-rate", "0.05", "--json"]) == 0  # a light load: colocated wins
    assert not any(r["verdict"]["pays_off"] for r in json.loads(capsys.readouterr().out)["links"])
    assert main(["plan-kv", "--model-path", tiny_model_path, "--no-calibrate"]) == 2  # rates missing
    assert "--prefill-tokens-per-s" in capsys.readouterr().err


def test_cli_calibrates_on_the_real_runner(tiny_model_path, capsys):
    argv = ["plan-kv", "--model-path", tiny_model_path, "--prompt-tokens", "256", "--calibrate-tokens", "128",
            "--num-threads", "2", "--json"]
    assert main(argv) == 0
    rates = json.loads(capsys.readouterr().out)["rates"]
    assert rates["prefill_s"] > 0 and rates["decode_step_s"] > 0
    assert "measured on 128 tokens x 2" in rates["source"] and "half: 1" in rates["source"]


@pytest.mark.skipif(importlib.util.find_spec("mooncake") is None, reason="mooncake-transfer-engine not installed")
def test_measure_link_moves_real_bytes_over_mooncake_tcp(tiny_model_path, capsys):
    argv = ["plan-kv", "--model-path", tiny_model_path, "--no-calibrate", "--prefill-tokens-per-s", "1000",
            "--decode-step-ms", "30", "--prompt-tokens", "512", "--measure-link", "--json"]
    assert main(argv) == 0
    m = json.loads(capsys.readouterr().out)["measured_link"]
    assert m["verified"] and m["bytes"] == 512 * 512 and m["transfer_s"] > 0
    assert m["factor_measured_over_predicted"] > 0


def test_shape_rejects_unknown_dtype(tiny_model_path):
    with pytest.raises(ValueError, match="--dtype"):
        model_shape(_args("--model-path", tiny_model_path, "--dtype", "int3"))
    assert KVShape(1, 1, 1, "fp8_e4m3").bytes_per_token == 2
