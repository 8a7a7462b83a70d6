"""Process-wide settings of the language (SGLang's `global_config`, same attribute names)."""

from __future__ import annotations


class GlobalConfig:
    """Mutable on purpose: users flip these switches at run time, as in SGLang."""

    def __init__(self):
        # At >= 2, print the text of every program after `run`.
        self.verbosity = 0
        # The backend used when `run(..., backend=None)`.
        self.default_backend = None
        # Sent with every gen as `sampling_params.skip_special_tokens` / `spaces_between_special_tokens`.
        self.skip_special_tokens_in_output = True
        self.spaces_between_special_tokens_in_out = True
        # `run_batch` traces the program and warms its constant prefix once (a zero-token request).
        self.enable_precache_with_tracing = True
        # A constant prefix shorter than this (characters) is not worth a warm-up request.
        self.precache_min_prefix_chars = 64
        # `join("concate_and_append")` uses a KV-cache path where the backend has one.
        self.enable_parallel_encoding = True


global_config = GlobalConfig()
