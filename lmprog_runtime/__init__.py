"""lmprog_runtime: the serving runtime behind lmprog programs (SGLang-compatible).

Heavy modules (torch, transformers) load only when `Engine` or `ServerArgs` is touched.
"""

__all__ = ["Engine", "ServerArgs", "__version__"]


def _package_version() -> str:
    try:
        from importlib.metadata import version
        return version("lmprog")
    except Exception:  # running from a source tree that is not installed
        return "0.1.0"


__version__ = _package_version()


def __getattr__(name):
    if name == "Engine":
        from lmprog_runtime.engine import Engine
        return Engine
    if name == "ServerArgs":
        from lmprog_runtime.config import ServerArgs
        return ServerArgs
    raise AttributeError(name)
