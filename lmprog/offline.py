"""SGLang's two ways to own a runtime from Python: `Engine` (in this process) and
`Runtime` (a server subprocess). Both are also program backends through `.endpoint`:

    llm = sgl.Engine()                                    # the embedded SmolLM2-135M-Instruct
    llm.generate("The capital of France is", {"max_new_tokens": 8})["text"]
    sgl.set_default_backend(llm)                          # programs run on it too

    runtime = sgl.Runtime(model_path="default")           # `lmprog-runtime serve` on a free port
    sgl.set_default_backend(runtime)
    runtime.shutdown()

The runtime (torch) is imported only when an `Engine` is constructed; `Runtime` never
imports it in this process.
"""

from __future__ import annotations

import atexit
import json
import socket
import subprocess
import sys
import time
from typing import Any, AsyncIterator, Optional

# The keywords of SGLang's Engine.generate that this runtime implements (the rest of its
# signature, e.g. image_data or lora_path, is refused by name, never ignored).
_GENERATE_KEYWORDS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                      "return_text_in_logprobs", "rid", "cache_salt", "extra_key", "return_prompt_token_ids",
                      "session_params")


class Engine:
    """`Engine(model_path=..., **server_flags)`: the runtime in this process (SGLang's
    offline engine). Every server flag is a keyword (`lmprog_runtime.ServerArgs`);
    `Engine(engine=e)` wraps an existing `lmprog_runtime.Engine` without owning it."""

    def __init__(self, engine=None, **server_flags):
        if engine is None:
            from lmprog_runtime import Engine as RuntimeEngine  # heavy (torch): only when asked for
            engine = RuntimeEngine(**server_flags)
            self._owns_engine = True
        else:
            if server_flags:
                raise TypeError(f"pass either engine= or server flags, not both: {sorted(server_flags)}.")
            self._owns_engine = False
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._endpoint = None

    # --- SGLang's offline API -------------------------------------------------------------
    def generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False, **kwargs):
        """A result dict (`text`, `output_ids`, `meta_info`), a list of them for a list of
        prompts, or with `stream=True` an iterator of chunks with the cumulative text."""
        return self.engine.generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids,
                                    stream=stream, **_generate_kwargs(kwargs))

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False,
                             **kwargs):
        """`generate` for asyncio code; with `stream=True`, an async iterator of chunks."""
        return await self.engine.async_generate(prompt=prompt, sampling_params=sampling_params,
                                                input_ids=input_ids, stream=stream, **_generate_kwargs(kwargs))

    def flush_cache(self) -> dict:
        return self.engine.flush_cache()

    def get_model_info(self) -> dict:
        return self.engine.get_model_info()

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def get_tokenizer(self):
        return self.tokenizer

    def __getattr__(self, name):
        """The runtime engine's other methods (update_weights_from_disk, open_session, ...)."""
        engine = self.__dict__.get("engine")
        if engine is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(engine, name)

    def shutdown(self) -> None:
        if self._endpoint is not None:
            self._endpoint = None
        if self._owns_engine:
            self.engine.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # --- as a program backend -------------------------------------------------------------
    @property
    def endpoint(self):
        """The program backend over this engine (what `set_default_backend(llm)` runs on)."""
        if self._endpoint is None:
            from lmprog.backends.engine import EngineBackend
            self._endpoint = EngineBackend(engine=self.engine)
        return self._endpoint

    def __repr__(self):
        return f"Engine({self.engine.server_args.model_path!r})"


def _generate_kwargs(kwargs: dict) -> dict:
    unknown = sorted(set(kwargs) - set(_GENERATE_KEYWORDS))
    if unknown:
        raise TypeError(f"generate() got unsupported keyword argument(s): {', '.join(unknown)} "
                        f"(supported: {', '.join(_GENERATE_KEYWORDS)}).")
    return {k: v for k, v in kwargs.items() if v is not None}


# ---------------------------------------------------------------------------------------------
class Runtime:
    """`Runtime(log_level="error", launch_timeout=300.0, **server_flags)`: start
    `lmprog-runtime serve` in a subprocess on a free port (from `port`, default 30000,
    upwards) and wait until `/health` answers. `.url` is its address, `.endpoint` a
    `RuntimeEndpoint` on it; `shutdown()` (also at exit) stops it."""

    def __init__(self, log_level: str = "error", launch_timeout: float = 300.0, **server_flags):
        from lmprog_runtime.config import ServerArgs  # torch-free

        port = _free_port(server_flags.pop("port", 30000))
        self.server_args = ServerArgs.from_kwargs(log_level=log_level, port=port, **server_flags)
        self.url = f"http://{self.server_args.host}:{port}"
        argv = [sys.executable, "-m", "lmprog_runtime", "serve", *_cli_flags(self.server_args.to_dict())]
        self._proc: Optional[subprocess.Popen] = subprocess.Popen(argv)
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(launch_timeout)
        except BaseException:
            self.shutdown()
            raise
        from lmprog.backends.runtime_endpoint import RuntimeEndpoint
        self.endpoint = RuntimeEndpoint(self.url, api_key=self.server_args.api_key)

    def _wait_healthy(self, timeout: float) -> None:
        import requests

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"the server process exited with code {self._proc.returncode} while "
                                   f"starting (run `lmprog-runtime serve` to see why)")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the server at {self.url} was not healthy within {timeout:.0f}s")

    # --- SGLang's Runtime API -------------------------------------------------------------
    def generate(self, prompt, sampling_params: Optional[dict] = None, return_logprob: bool = False,
                 logprob_start_len: Optional[int] = None, top_logprobs_num: Optional[int] = None) -> str:
        """The `/generate` answer as a JSON string (SGLang's return type)."""
        body = _generate_body(prompt, sampling_params, return_logprob, logprob_start_len, top_logprobs_num)
        return json.dumps(self.endpoint._generate(body))

    async def async_generate(self, prompt, sampling_params: Optional[dict] = None) -> AsyncIterator[str]:
        """The new text of each streamed chunk."""
        import aiohttp

        body = {**_generate_body(prompt, sampling_params, False, None, None), "stream": True}
        headers = {"Authorization": f"Bearer {self.server_args.api_key}"} if self.server_args.api_key else {}
        seen = ""
        async with aiohttp.ClientSession() as session:
            async with session.post(self.url + "/generate", json=body, headers=headers) as resp:
                async for line in resp.content:
                    data = _sse_data(line)
                    if data is None:
                        continue
                    if "error" in data:
                        raise RuntimeError(f"stream failed: {data['error']}")
                    text = data["text"]
                    delta, seen = (text[len(seen):], text) if text.startswith(seen) else (text, seen + text)
                    if delta:
                        yield delta

    add_request = async_generate

    def get_tokenizer(self):
        """The served model's tokenizer (torch-free: `lmprog_runtime.tokenizer`)."""
        from lmprog_runtime.tokenizer import load_tokenizer

        return load_tokenizer(self.server_args.tokenizer_path or self.server_args.model_path)

    def get_server_info(self) -> dict:
        return self.endpoint.get_server_info()

    def flush_cache(self):
        return self.endpoint.flush_cache()

    def cache_prefix(self, prefix: str) -> None:
        self.endpoint.cache_prefix(prefix)

    def shutdown(self) -> None:
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()  # SIGTERM: the server stops its scheduler child and exits 0
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)

    def __enter__(self) -> "Runtime":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass

    def __repr__(self):
        return f"Runtime({self.url!r})"


def _generate_body(prompt, sampling_params, return_logprob, logprob_start_len, top_logprobs_num) -> dict:
    body: dict = {"text": prompt, "sampling_params": sampling_params or {}}
    if return_logprob:
        body["return_logprob"] = True
        body["return_text_in_logprobs"] = True
    if logprob_start_len is not None:
        body["logprob_start_len"] = logprob_start_len
    if top_logprobs_num is not None:
        body["top_logprobs_num"] = top_logprobs_num
    return body


def _sse_data(line: bytes) -> Optional[dict]:
    line = line.strip()
    if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
        return None
    return json.loads(line[5:])


def _free_port(start: int) -> int:
    """The first port from `start` up to 40000 that nobody listens on (SGLang's scan)."""
    for port in range(start, 40000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{start}, 40000)")


def _cli_flags(values: dict) -> list:
    """ServerArgs values as `serve` flags; defaults stay implicit (so the CLI's own parsing
    is the one that decides), booleans become `--flag` / `--no-flag`."""
    from lmprog_runtime.config import ServerArgs

    defaults = ServerArgs().to_dict()
    argv = []
    for name, value in values.items():
        if value == defaults[name]:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        else:
            argv.extend([flag, str(value)])
    return argv
