"""The package surface: SGLang's public names, and no heavy imports."""

import os
import subprocess
import sys

import lmprog

SGLANG_NAMES = ["assistant", "assistant_begin", "assistant_end", "flush_cache", "function", "gen", "gen_int",
                "gen_string", "get_server_info", "image", "select", "separate_reasoning", "set_default_backend",
                "system", "system_begin", "system_end", "user", "user_begin", "user_end", "video",
                "RuntimeEndpoint", "greedy_token_selection", "token_length_normalized",
                "unconditional_likelihood_normalized", "global_config", "OpenAI", "Engine", "Runtime"]


def test_sglang_public_names_exist():
    missing = [n for n in SGLANG_NAMES if not hasattr(lmprog, n)]
    assert not missing
    assert all(hasattr(lmprog, n) for n in lmprog.__all__)


def test_import_is_pure_python_and_light():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import sys, lmprog\n"
            "heavy = [m for m in ('torch', 'lmprog_runtime', 'openai', 'requests', 'numpy') if m in sys.modules]\n"
            "print(heavy)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
