"""`Engine`: the runtime in this process, no HTTP. `lmprog_runtime` is imported only on construction."""

from __future__ import annotations

from typing import Iterator, Optional

from lmprog.backends.native import NativeBackend
from lmprog.chat_template import ChatTemplate

_GENERATE_KEYS = ("sampling_params", "input_ids", "return_logprob", "logprob_start_len", "top_logprobs_num",
                  "token_ids_logprob", "return_text_in_logprobs", "stream", "rid", "cache_salt")


class EngineBackend(NativeBackend):
    """The program backend over an in-process runtime: `EngineBackend(model_path=..., **server_flags)`
    starts one, `EngineBackend(engine=e)` wraps a `lmprog_runtime.Engine`. (`lmprog.Engine`, SGLang's
    offline engine, hands programs one of these as its `.endpoint`.)

    Payloads are exactly those `RuntimeEndpoint` would POST; `lmprog_runtime.Engine.generate`
    answers with the same JSON-shaped dicts. Attributes this class lacks (e.g. `tokenizer`)
    are looked up on the wrapped engine.
    """

    def __init__(self, engine=None, *, chat_template_name: Optional[str] = None,
                 chat_template: Optional[ChatTemplate] = None, **engine_kwargs):
        if engine is None:
            from lmprog_runtime import Engine as RuntimeEngine  # heavy (torch): only when asked for
            engine = RuntimeEngine(**engine_kwargs)
            self._owns_engine = True
        else:
            if engine_kwargs:
                raise TypeError(f"pass either engine= or engine flags, not both: {sorted(engine_kwargs)}.")
            self._owns_engine = False
        self.engine = engine
        super().__init__(chat_template_name=chat_template_name, chat_template=chat_template)

    def _call_engine(self, payload: dict):
        kwargs = {k: payload[k] for k in _GENERATE_KEYS if k in payload}
        return self.engine.generate(prompt=payload.get("text"), **kwargs)

    def _generate(self, payload: dict):
        return self._call_engine(payload)

    def _generate_stream(self, payload: dict) -> Iterator[dict]:
        return iter(self._call_engine(payload))

    def get_model_info(self) -> dict:
        return self.engine.get_model_info()

    def get_server_info(self) -> dict:
        return self.engine.get_server_info()

    def flush_cache(self):
        return self.engine.flush_cache()

    def shutdown(self) -> None:
        if self._owns_engine:
            self.engine.shutdown()

    def __getattr__(self, name):
        engine = self.__dict__.get("engine")
        if engine is None or name.startswith("_"):
            raise AttributeError(name)
        return getattr(engine, name)

    def __repr__(self):
        return f"EngineBackend({self.engine!r})"

