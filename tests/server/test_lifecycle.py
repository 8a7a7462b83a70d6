"""Servers of their own: --api-key then SIGINT; listen-before-load, a taken port, and
the scheduler process dying (in-flight requests fail, then the server exits with code 3).

The tests of the module-scoped server run in file order, each leaving it in the state
the next one expects.
"""

import json
import os
import signal
import subprocess
import tempfile
import time

import openai
import pytest
import requests

from server_harness import LiveServer, pid_alive, port_is_free

EXIT_SCHEDULER_DIED = 3

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
    assert r.status_code == 401
    err = r.json()["error"]  # the OpenAI envelope the official clients parse
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "authentication_error" and err["code"] == 401 and "API key" in err["message"]
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
    with pytest.raises(openai.AuthenticationError) as excinfo:
        bad.models.list()
    assert excinfo.value.type == "authentication_error" and str(excinfo.value.code) == "401"


def test_sigint_shuts_down_cleanly(server):
    tmp = tempfile.gettempdir()
    ipc_dirs = {d for d in os.listdir(tmp) if d.startswith("lmprog-ipc-")}
    code = server.stop(signal.SIGINT)
    assert code == 0, server.log_tail()
    assert port_is_free(server.port)
    left = {d for d in os.listdir(tmp) if d.startswith("lmprog-ipc-")}
    assert ipc_dirs - left, "this server's IPC folder was not removed"


def _start_watching_health(srv: LiveServer) -> list:
    """Start `srv` by hand and record each /health answer until it is 200."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    log = open(srv.log_path, "wb")
    srv.proc = subprocess.Popen(srv.argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=repo)
    seen, deadline = [], time.monotonic() + 240
    while time.monotonic() < deadline:
        assert srv.proc.poll() is None, srv.log_tail()
        try:
            r = requests.get(srv.url + "/health", timeout=5)
        except requests.RequestException:
            time.sleep(0.05)
            continue
        seen.append((r.status_code, r.json() if r.status_code != 200 else None))
        if r.status_code == 200:
            return seen
        if len(seen) == 1:  # every other route says "loading" too, in the envelope
            m = requests.get(srv.url + "/v1/models", timeout=5)
            seen.append((m.status_code, m.json()))
        time.sleep(0.05)
    raise AssertionError(f"never healthy: {seen[-3:]}\n{srv.log_tail()}")


@pytest.fixture(scope="module")
def doomed(tiny_model_path, tmp_path_factory):
    srv = LiveServer(tiny_model_path, tmp_path_factory.mktemp("doomed"))
    srv.loading_answers = _start_watching_health(srv)
    yield srv
    srv.stop(signal.SIGKILL)


def test_listens_while_loading(doomed):
    answers = doomed.loading_answers
    assert answers[-1] == (200, None)
    loading = [body for code, body in answers[:-1]]
    assert loading, "the server answered 200 at its first /health; nothing showed the loading state"
    for body in loading:
        assert body["status"] == "loading" and body["error"]["code"] == 503
        assert body["error"]["type"] == "service_unavailable" and "elapsed_s" in body["progress"]


def test_taken_port_fails_before_loading(doomed, tiny_model_path, tmp_path):
    second = LiveServer(tiny_model_path, tmp_path)
    argv = list(second.argv)
    argv[argv.index("--port") + 1] = str(doomed.port)
    t0 = time.monotonic()
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 1 and "cannot listen" in out.stderr, out.stderr
    assert "Loading model" not in out.stdout  # it never spawned the scheduler
    assert time.monotonic() - t0 < 60


def test_scheduler_death_fails_then_exits(doomed):
    url = doomed.url
    pid = requests.get(url + "/get_server_info", timeout=30).json()["scheduler_pid"]
    resp = requests.post(url + "/generate", stream=True, timeout=60, json={
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
    assert error["error"]["type"] == "service_unavailable" and error["error"]["retryable"] is True
    # until it is gone, every route answers 503 in the envelope; then it exits with code 3
    for method, path, body in [("POST", "/generate", {"text": "hi"}), ("GET", "/v1/models", None),
                               ("GET", "/get_model_info", None), ("POST", "/tokenize", {"prompt": "hi"}),
                               ("GET", "/metrics", None), ("GET", "/health", None)]:
        try:
            r = requests.request(method, url + path, json=body, timeout=10)
        except requests.ConnectionError:
            break  # already exited
        assert r.status_code == 503 and r.json()["status"] == "dead", (path, r.text)
    assert doomed.proc.wait(30) == EXIT_SCHEDULER_DIED, doomed.log_tail()
    assert not pid_alive(pid)


def _kill_scheduler_mid_stream(url: str) -> int:
    pid = requests.get(url + "/get_server_info", timeout=30).json()["scheduler_pid"]
    resp = requests.post(url + "/generate", stream=True, timeout=60, json={
        "text": "long", "stream": True, "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}})
    lines = resp.iter_lines()
    next(line for line in lines if line.startswith(b"data: "))
    os.kill(pid, signal.SIGKILL)
    rest = [line for line in lines if line.startswith(b"data: ")]
    assert json.loads(rest[-2][len(b"data: "):])["error"]["code"] == 503 and rest[-1] == b"data: [DONE]"
    return pid


def test_scheduler_restart_then_exit(tiny_model_path, tmp_path):
    srv = LiveServer(tiny_model_path, tmp_path, ["--scheduler-restart", "1"]).start()
    try:
        old = _kill_scheduler_mid_stream(srv.url)
        deadline, states = time.monotonic() + 180, set()
        while time.monotonic() < deadline:  # 503 "restarting" (or "dead" for an instant), then 200
            r = requests.get(srv.url + "/health", timeout=30)
            if r.status_code == 200:
                break
            states.add(r.json()["status"])
            time.sleep(0.2)
        assert r.status_code == 200 and states <= {"restarting", "dead"}, (states, srv.log_tail())
        info = requests.get(srv.url + "/get_server_info", timeout=30).json()
        assert info["scheduler_pid"] != old and not pid_alive(old)
        out = requests.post(srv.url + "/generate", timeout=60, json={"text": "hi", "sampling_params": {
            "max_new_tokens": 3, "temperature": 0}}).json()
        assert out["meta_info"]["completion_tokens"] == 3
        metrics = requests.get(srv.url + "/metrics", timeout=30).text
        assert 'lmprog:scheduler_restarts_total{model_name=' in metrics
        assert [ln for ln in metrics.splitlines() if ln.startswith("lmprog:scheduler_restarts_total")][0].endswith(" 1.0")
        _kill_scheduler_mid_stream(srv.url)  # the restart budget is spent: exit 3
        assert srv.proc.wait(30) == EXIT_SCHEDULER_DIED, srv.log_tail()
    finally:
        srv.stop(signal.SIGKILL)
