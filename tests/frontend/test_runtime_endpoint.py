"""RuntimeEndpoint's HTTP transport against a scripted HTTP server (auth, keep-alive, SSE, errors)."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import lmprog as sgl
from lmprog.interpreter import ProgramError
from scripted_backend import CHATML_JINJA, ScriptedBackend


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def log_message(self, *args):
        pass

    def _reply(self, status, body, content_type="application/json"):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, payload=None):
        self.server.seen.append({"path": self.path, "auth": self.headers.get("Authorization"),
                                 "port": self.client_address[1], "payload": payload})

    def do_GET(self):
        self._record()
        if self.path == "/get_model_info":
            self._reply(200, {"model_path": "scripted/model", "chat_template": CHATML_JINJA})
        elif self.path == "/get_server_info":
            self._reply(200, {"version": "http-scripted"})
        else:
            self._reply(404, {"detail": "Not Found"})

    def do_POST(self):
        payload = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        self._record(payload)
        if self.path == "/flush_cache":
            return self._reply(200, b"Cache flushed.\n", "text/plain")
        if payload.get("text") == "bad":
            return self._reply(400, {"error": {"message": "regex does not compile"}})
        result = self.server.model._generate(payload)
        if not payload.get("stream"):
            return self._reply(200, result)
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in self.server.model._generate_stream(
            {**payload, "stream": False})]
        self._reply(200, ("".join(events) + "data: [DONE]\n\n").encode(), "text/event-stream")


@pytest.fixture
def server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.seen, srv.model = [], ScriptedBackend()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def test_endpoint_generates_with_auth_and_keep_alive(server):
    backend = sgl.RuntimeEndpoint(f"http://127.0.0.1:{server.server_port}", api_key="sk-test")
    assert backend.get_model_name() == "scripted/model" and backend.get_chat_template().stop_str == ("<|im_end|>",)

    @sgl.function
    def prog(s):
        s += sgl.user("hi") + sgl.assistant(sgl.gen("a", max_tokens=4))
        s += "Pick:" + sgl.select("c", [" x", " y"])

    for _ in range(3):
        state = prog.run(backend=backend)
        assert state["a"] == " scripted answer" and state["c"] in (" x", " y")
    assert all(r["auth"] == "Bearer sk-test" for r in server.seen)
    assert len({r["port"] for r in server.seen}) <= 2  # connections are reused, not one per request
    assert sgl.get_server_info(backend) == {"version": "http-scripted"}
    assert sgl.flush_cache(backend) is None


def test_endpoint_streams_sse(server):
    backend = sgl.RuntimeEndpoint(f"http://127.0.0.1:{server.server_port}")

    @sgl.function
    def prog(s):
        s += "Q:" + sgl.gen("a", max_tokens=4)

    state = prog.run(stream=True, backend=backend)
    assert list(state.text_iter("a")) == [" scripted", " answer"]
    assert server.seen[-1]["payload"]["stream"] is True and server.seen[-1]["auth"] is None


def test_endpoint_http_error_names_status_and_body(server):
    backend = sgl.RuntimeEndpoint(f"http://127.0.0.1:{server.server_port}")

    @sgl.function
    def prog(s):
        s += "bad"
        s += sgl.gen("a")

    with pytest.raises(ProgramError, match="HTTP 400.*regex does not compile"):
        prog.run(backend=backend)["a"]


def test_endpoint_unreachable_is_an_error_at_construction():
    with pytest.raises(Exception):
        sgl.RuntimeEndpoint("http://127.0.0.1:9", timeout=2)
