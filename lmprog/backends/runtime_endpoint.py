"""`RuntimeEndpoint`: a running lmprog_runtime (or SGLang) server, over HTTP with keep-alive."""

from __future__ import annotations

import json
from typing import Iterator, Optional

from lmprog.backends.native import NativeBackend
from lmprog.chat_template import ChatTemplate


class RuntimeEndpoint(NativeBackend):
    """`RuntimeEndpoint("http://127.0.0.1:30000", api_key=...)`.

    One `requests.Session` (a pool of keep-alive connections) serves every thread.
    The chat template follows the served model (`/get_model_info`) unless
    `chat_template_name` or `chat_template` says otherwise.
    """

    def __init__(self, base_url: str, api_key: Optional[str] = None, verify: Optional[str] = None,
                 chat_template_name: Optional[str] = None, chat_template: Optional[ChatTemplate] = None,
                 timeout: Optional[float] = 600.0, pool_size: int = 128):
        import requests
        from requests.adapters import HTTPAdapter

        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.verify = verify
        self.timeout = timeout
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_connections=1, pool_maxsize=pool_size)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._session.headers.update({"Content-Type": "application/json; charset=utf-8"})
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        super().__init__(chat_template_name=chat_template_name, chat_template=chat_template)

    # --- transport ------------------------------------------------------------------------
    def _request(self, method: str, path: str, payload=None, stream: bool = False):
        kwargs = {"timeout": self.timeout, "stream": stream}
        if self.verify is not None:
            kwargs["verify"] = self.verify
        if payload is not None:
            kwargs["data"] = json.dumps(payload)
        res = self._session.request(method, self.base_url + path, **kwargs)
        if res.status_code != 200:
            raise RuntimeError(f"{method} {path} failed with HTTP {res.status_code}: {_error_body(res)}")
        return res

    def _generate(self, payload: dict):
        return self._request("POST", "/generate", payload).json()

    def _generate_stream(self, payload: dict) -> Iterator[dict]:
        with self._request("POST", "/generate", payload, stream=True) as res:
            for line in res.iter_lines(decode_unicode=False):
                if not line.startswith(b"data:"):
                    continue
                body = line[5:].strip()
                if body == b"[DONE]":
                    return
                yield json.loads(body)

    def get_model_info(self) -> dict:
        return self._request("GET", "/get_model_info").json()

    def get_server_info(self) -> dict:
        return self._request("GET", "/get_server_info").json()

    def flush_cache(self):
        self._request("POST", "/flush_cache")

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def shutdown(self) -> None:
        self._session.close()

    def __repr__(self):
        return f"RuntimeEndpoint({self.base_url!r})"


def _error_body(res):
    try:
        return res.json()
    except ValueError:
        return res.text
