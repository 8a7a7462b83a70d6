"""The server process runs no model code: started the way `lmprog-runtime serve` starts it
(`launch.main`), serving requests through the HTTP app and the TokenizerManager, it never
imports torch, transformers or numpy (the scheduler child does; that is another process)."""

import json
import os
import subprocess
import sys

from server_harness import free_port
from tiny_model import smollm2_tokenizer

HEAVY = ("torch", "transformers", "numpy")

# Runs in the server's own process: launch.main() on the main thread (it owns the signal
# handlers); a thread waits for /health, sends requests, records sys.modules, then SIGINTs.
DRIVER = r"""
import json, os, signal, sys, threading, time, urllib.request

def call(path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(URL + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return r.status, r.read().decode()

def drive():
    result = {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if call("/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
        msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi 😀"}]
        result["chat_tokens"] = json.loads(call("/tokenize", {"messages": msgs})[1])["tokens"]
        result["tokens"] = json.loads(call("/tokenize", {"prompt": "Héllo  world"})[1])["tokens"]
        gen = json.loads(call("/generate", {"text": "Hello", "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})[1])
        result["generate"] = [gen["text"], gen["meta_info"]["completion_tokens"]]
        stream = call("/generate", {"text": "Hello", "stream": True, "sampling_params": {
            "max_new_tokens": 8, "temperature": 0, "ignore_eos": True}})[1]
        result["stream_last"] = [json.loads(l[6:])["text"] for l in stream.splitlines()
                                 if l.startswith("data: {")][-1]
        chat = json.loads(call("/v1/chat/completions", {"model": "x", "messages": msgs, "max_tokens": 4})[1])
        result["chat_finish"] = chat["choices"][0]["finish_reason"]
    except Exception as e:
        result["error"] = repr(e)
    result["modules"] = sorted(m for m in HEAVY if m in sys.modules)
    print("RESULT " + json.dumps(result), flush=True)
    os.kill(os.getpid(), signal.SIGINT)

HEAVY = %r
URL = "http://127.0.0.1:%d"
if __name__ == "__main__":  # the spawned scheduler child re-imports this file
    threading.Thread(target=drive, daemon=True).start()
    from lmprog_runtime.server.launch import main
    sys.exit(main(%r))
"""


def test_server_process_never_imports_torch(tiny_model_path, tmp_path):
    port = free_port()
    argv = ["serve", "--model-path", str(tiny_model_path), "--host", "127.0.0.1", "--port", str(port),
            "--dtype", "float32", "--max-total-tokens", "4096", "--num-threads", "1",
            "--log-level", "warning"]
    script = tmp_path / "drive_server.py"
    script.write_text(DRIVER % (HEAVY, port, argv))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, str(script)], env=env, cwd=repo, capture_output=True,
                         text=True, timeout=600)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"rc={out.returncode}\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    assert "error" not in result, (result, out.stderr[-3000:])
    assert result["modules"] == []
    assert out.returncode == 0, out.stderr[-3000:]
    hf = smollm2_tokenizer()  # the transformers tokenizer: the same ids
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi 😀"}]
    assert result["chat_tokens"] == hf.apply_chat_template(msgs, add_generation_prompt=True, return_dict=False)
    assert result["tokens"] == hf.encode("Héllo  world")
    text, n = result["generate"]
    assert n == 8 and result["stream_last"] == text
    assert result["chat_finish"] == "length"
