"""A server of its own: --api-key, then the scheduler process dies, then SIGINT.

The tests run in file order on one server (module-scoped), each leaving it in the state
the next one expects.
"""

import json
import os
import signal
import tempfile
import time

import openai
import pytest
import requests

from server_harness import LiveServer, pid_alive, port_is_free

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    srv = LiveServer(tiny_model_path, tmp_path_factory.mktemp("secured"), ["--api-key", KEY]).start()
    yield srv
    srv.stop(signal.SIGKILL)


def test_auth_required(server):
    url = server.url
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    assert requests.post(url + "/generate", json=body, timeout=30).status_code == 401
    bad = {"Authorization": "Bearer wrong"}
    r = requests.post(url + "/generate", json=body, headers=bad, timeout=30)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert requests.post(url + "/generate", json=body, headers=AUTH, timeout=30).status_code == 200
    assert requests.get(url + "/get_server_info", timeout=30).status_code == 401
    info = requests.get(url + "/get_server_info", headers=AUTH, timeout=30).json()
    assert KEY not in json.dumps(info)
    # health and metrics stay open
    assert requests.get(url + "/health", timeout=30).status_code == 200
    assert requests.get(url + "/metrics", timeout=30).status_code == 200


def test_auth_with_openai_client(server):
    good = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="m", prompt="hi", max_tokens=2).usage.completion_tokens == 2
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_scheduler_death_fails_fast(server):
    url = server.url
    pid = requests.get(url + "/get_server_info", headers=AUTH, timeout=30).json()["scheduler_pid"]
    resp = requests.post(url + "/generate", headers=AUTH, stream=True, timeout=60, json={
        "text": "long", "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})
    lines = resp.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    rest = [line for line in lines if line.startswith(b"data: ")]
    assert time.monotonic() - t0 < 10
    error = json.loads(rest[-2][len(b"data: "):])
    assert error["error"]["code"] == 503 and "scheduler" in error["error"]["message"]
    assert rest[-1] == b"data: [DONE]"
    t0 = time.monotonic()
    r = requests.post(url + "/generate", headers=AUTH, json={"text": "hi"}, timeout=30)
    assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
    r = requests.post(url + "/v1/chat/completions", headers=AUTH, timeout=30,
                      json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503
    assert requests.get(url + "/health", timeout=30).status_code == 503
    assert requests.get(url + "/ready", timeout=30).status_code == 503
    assert requests.get(url + "/get_server_info", headers=AUTH, timeout=30).status_code == 503
    assert time.monotonic() - t0 < 10
    assert not pid_alive(pid)


def test_sigint_shuts_down_cleanly(server):
    tmp = tempfile.gettempdir()
    ipc_dirs = {d for d in os.listdir(tmp) if d.startswith("lmprog-ipc-")}
    code = server.stop(signal.SIGINT)
    assert code == 0, server.log_tail()
    assert port_is_free(server.port)
    left = {d for d in os.listdir(tmp) if d.startswith("lmprog-ipc-")}
    assert ipc_dirs - left, "this server's IPC folder was not removed"
