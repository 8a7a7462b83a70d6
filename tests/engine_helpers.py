"""Helpers for tests that build their own Engine (importable from any test folder)."""


def make_engine(model_path, **kwargs):
    """An Engine with test defaults; the caller shuts it down."""
    from lmprog_runtime import Engine

    kwargs.setdefault("dtype", "float32")
    return Engine(model_path=model_path, **kwargs)
