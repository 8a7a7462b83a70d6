"""Prefill/decode disaggregation between real servers (two processes each, KV over Mooncake
TCP) behind a tiny proxy: greedy outputs identical to a colocated server, streaming and not,
logprobs merged as the router does; the request fields validated at the boundary; a decode
or prefill server that dies ends its rooms with a 5xx and no leaked KV on the survivor."""

import os
import signal
import threading
import time

import pytest
import requests

from pd_helpers import mooncake_or_skip
from pd_servers import proxy_generate, start_pair, with_bootstrap
from server_harness import LiveServer, wait_idle

GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PROMPT = "A short story about a lighthouse keeper who collects clocks. " * 4


@pytest.fixture(scope="module")
def pair(tiny_model_path, tmp_path_factory):
    mooncake_or_skip()
    prefill, decode, port = start_pair(tiny_model_path, tmp_path_factory.mktemp("pd"))
    yield prefill, decode, port
    for s in (prefill, decode):
        assert s.stop(signal.SIGTERM) == 0, s.log_tail()


def _kill(server) -> None:
    """SIGKILL the server and its scheduler process (which holds the pool and the KV endpoint)."""
    child = requests.get(server.url + "/get_server_info", timeout=30).json()["scheduler_pid"]
    os.kill(child, signal.SIGKILL)
    server.stop(signal.SIGKILL)


def _audit(*servers) -> None:
    for s in servers:
        assert wait_idle(s.url)["integrity"] == "ok"


def test_non_streaming_matches_colocated_with_merged_logprobs(live_server, pair):
    prefill, decode, port = pair
    body = {"text": PROMPT, "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
    want = requests.post(live_server + "/generate", json=body, timeout=60).json()
    status, got = proxy_generate(prefill.url, decode.url, port, body)
    assert status == 200, got
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    for key in ("input_token_logprobs", "output_token_logprobs"):
        assert got["meta_info"][key] == want["meta_info"][key], key
    _audit(prefill, decode)


def test_streaming_matches_colocated(live_server, pair):
    from pd_servers import sse_events
    prefill, decode, port = pair
    body = {"text": PROMPT + " Go on.", "sampling_params": GREEDY, "stream": True, "return_logprob": True}
    want = sse_events(requests.post(live_server + "/generate", json=body, timeout=60, stream=True))
    status, got = proxy_generate(prefill.url, decode.url, port, body)
    assert status == 200
    assert got[-1] == "[DONE]"
    final = want[-2]["output_ids"]
    assert got[-2]["output_ids"] == final and got[-2]["text"] == want[-2]["text"]
    # chunks are cumulative; how many tokens one carries depends on timing (as colocated)
    assert all(final[:len(e["output_ids"])] == e["output_ids"] for e in got[:-1])
    assert len(got) > 3
    assert got[-2]["meta_info"]["output_token_logprobs"] == want[-2]["meta_info"]["output_token_logprobs"]
    _audit(prefill, decode)


def test_openai_completions_through_the_pair(live_server, pair):
    prefill, decode, port = pair
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    want = requests.post(live_server + "/v1/completions", json=body, timeout=60).json()
    boot = with_bootstrap(body, port)
    out = {}
    t = threading.Thread(target=lambda: out.update(p=requests.post(prefill.url + "/v1/completions", json=boot,
                                                                   timeout=60)))
    t.start()
    d = requests.post(decode.url + "/v1/completions", json=boot, timeout=60)
    t.join()
    assert out["p"].status_code == 200 and d.status_code == 200, d.text
    assert d.json()["choices"][0]["text"] == want["choices"][0]["text"]


@pytest.mark.parametrize("field, value", [("bootstrap_room", -1), ("bootstrap_room", 1 << 63), ("bootstrap_room", "7"),
                                          ("bootstrap_port", 0), ("bootstrap_host", ""), ("bootstrap_pair_key", 5)])
def test_bootstrap_fields_are_validated(pair, field, value):
    prefill, _, port = pair
    body = {**with_bootstrap({"text": "hi", "sampling_params": {"max_new_tokens": 1}}, port), field: value}
    r = requests.post(prefill.url + "/generate", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == field, r.text


def test_bootstrap_fields_on_a_colocated_server_are_a_400(live_server):
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 1}, "bootstrap_host": "127.0.0.1",
            "bootstrap_room": 7}
    r = requests.post(live_server + "/generate", json=body, timeout=30)
    assert r.status_code == 400 and "--disaggregation-mode" in r.json()["error"]["message"]


def test_bootstrap_server_routes(pair):
    prefill, _, port = pair
    base = f"http://127.0.0.1:{port}"
    assert requests.get(base + "/health", timeout=10).text == "OK"
    layout = requests.get(base + "/route", params={"prefill_dp_rank": -1, "prefill_cp_rank": -1,
                                                   "target_tp_rank": -1, "target_pp_rank": -1}, timeout=10).json()
    assert layout["attn_tp_size"] == 1 and layout["dp_size"] == 1 and layout["page_size"] == 1
    rank = requests.get(base + "/route", params={"prefill_dp_rank": 0, "prefill_cp_rank": 0,
                                                 "target_tp_rank": 0, "target_pp_rank": 0}, timeout=10).json()
    assert rank["rank_ip"] == "127.0.0.1" and rank["rank_port"] > 0


# -- a server dies --------------------------------------------------------------------------------
def test_decode_server_dies_mid_transfer(tiny_model_path, tmp_path, pair):
    """The decode half handshakes (its slots are with the prefill server), then its server is
    killed: the prefill half's Mooncake writes fail, it ends with a 500, its KV freed."""
    prefill, _, port = pair
    decode = LiveServer(tiny_model_path, tmp_path, extra_args=["--disaggregation-mode", "decode"]).start()
    body = with_bootstrap({"text": PROMPT + " (decode dies)", "sampling_params": GREEDY}, port)
    def doomed():
        try:
            requests.post(decode.url + "/generate", json=body, timeout=60)
        except requests.RequestException:  # its server is killed under it
            pass
    t = threading.Thread(target=doomed)
    t.start()
    time.sleep(1.5)  # the handshake is at the prefill server now
    _kill(decode)
    t.join(60)
    r = requests.post(prefill.url + "/generate", json=body, timeout=120)
    assert r.status_code >= 500, r.text
    _audit(prefill)


def test_prefill_server_dies(tiny_model_path, tmp_path, pair):
    """The prefill server is killed while a decode request waits for its KV: the decode side's
    heartbeat misses the bootstrap server and ends the room with a 500, slots freed."""
    _, decode, _ = pair
    mooncake_or_skip()
    from server_harness import free_port
    port = free_port()
    prefill = LiveServer(tiny_model_path, tmp_path, extra_args=[
        "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(port)]).start()
    body = with_bootstrap({"text": PROMPT + " (prefill dies)", "sampling_params": GREEDY}, port)
    out = {}
    t = threading.Thread(target=lambda: out.update(r=requests.post(decode.url + "/generate", json=body, timeout=120)))
    t.start()
    time.sleep(1.5)
    _kill(prefill)
    t.join(120)
    assert out["r"].status_code >= 500, out["r"].text
    _audit(decode)


# -- the real router ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def router(pair, tmp_path_factory):
    """`sglang-router launch --pd-disaggregation` in front of the pair (lmprog servers, unchanged)."""
    import shutil
    import subprocess
    import sys
    from server_harness import free_port
    binary = shutil.which("sglang-router") or os.path.join(os.path.dirname(sys.executable), "sglang-router")
    if not os.path.exists(binary):
        pytest.skip("sglang-router not installed (pip install sglang-router)")
    prefill, decode, port = pair
    rport = free_port()
    log = open(tmp_path_factory.mktemp("router") / "router.log", "wb")
    proc = subprocess.Popen([binary, "launch", "--pd-disaggregation", "--prefill", prefill.url, str(port),
                             "--decode", decode.url, "--host", "127.0.0.1", "--port", str(rport),
                             "--worker-startup-check-interval", "1", "--policy", "round_robin"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{rport}"
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, open(log.name).read()[-3000:]
        try:
            if requests.get(url + "/health", timeout=5).status_code == 200:
                break
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, open(log.name).read()[-3000:]
        time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(30)
    log.close()


def test_sglang_router_drives_the_pair(live_server, pair, router):
    body = {"text": PROMPT + " Routed.", "sampling_params": GREEDY, "return_logprob": True, "logprob_start_len": 0}
    want = requests.post(live_server + "/generate", json=body, timeout=60).json()
    r = requests.post(router + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["output_ids"] == want["output_ids"] and got["text"] == want["text"]
    for key in ("input_token_logprobs", "output_token_logprobs"):  # the router re-prints floats (last ulp)
        assert _as_numbers(got["meta_info"][key]) == pytest.approx(_as_numbers(want["meta_info"][key]),
                                                                   rel=1e-12, abs=1e-12), key
        assert [e[1] for e in got["meta_info"][key]] == [e[1] for e in want["meta_info"][key]]
    _audit(*pair[:2])


def _as_numbers(entries):
    return [0.0 if e[0] is None else e[0] for e in entries]


def test_sglang_router_streams_from_the_pair(live_server, pair, router):
    from pd_servers import sse_events
    body = {"text": PROMPT + " Routed, streamed.", "sampling_params": GREEDY, "stream": True}
    want = sse_events(requests.post(live_server + "/generate", json=body, timeout=60, stream=True))
    got = sse_events(requests.post(router + "/generate", json=body, timeout=120, stream=True))
    assert got[-1] == "[DONE]" and got[-2]["output_ids"] == want[-2]["output_ids"]
    assert got[-2]["text"] == want[-2]["text"]
    _audit(*pair[:2])


def test_sglang_router_chat_completions(live_server, pair, router):
    body = {"model": "any", "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 10, "temperature": 0}
    want = requests.post(live_server + "/v1/chat/completions", json=body, timeout=60).json()
    r = requests.post(router + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
    _audit(*pair[:2])
