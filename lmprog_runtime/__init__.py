"""lmprog_runtime: the serving runtime behind lmprog programs (SGLang-compatible).

Heavy modules (torch, transformers) load only when `Engine` or `ServerArgs` is touched.
"""

__all__ = ["Engine", "ServerArgs"]


def __getattr__(name):
    if name == "Engine":
        from lmprog_runtime.engine import Engine
        return Engine
    if name == "ServerArgs":
        from lmprog_runtime.config import ServerArgs
        return ServerArgs
    raise AttributeError(name)
