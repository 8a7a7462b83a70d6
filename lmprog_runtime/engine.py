"""Engine: the whole runtime in-process — the same scheduler and tokenizer manager the
server runs, linked by local queues instead of sockets.

    from lmprog_runtime import Engine
    with Engine() as engine:                       # the embedded SmolLM2-135M-Instruct
        print(engine.generate("The capital of France is", {"max_new_tokens": 8})["text"])
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Any, AsyncIterator, Dict, Iterator, List, Optional, Union

from lmprog_runtime import __version__
from lmprog_runtime.config import ServerArgs
from lmprog_runtime.messages import INSPECT_MAX_NODES_CAP, INSPECT_MAX_NODES_DEFAULT, InspectReq
from lmprog_runtime.messages import MEMORY_TAGS, HiCacheStorageReq, MemoryOccupationReq, UpdateWeightsReq
from lmprog_runtime.model_paths import DEFAULT_MODEL, DEFAULT_MODEL_ID, resolve_model_path, tokenizer_folder_if_ready
from lmprog_runtime.tokenizer_manager import TokenizerManager

STORAGE_ATTACH_TIMEOUT_S = 120.0  # joining a remote store (Mooncake) may take a while

logger = logging.getLogger(__name__)

_GENERATE_KEYS = ("return_logprob", "logprob_start_len", "top_logprobs_num", "token_ids_logprob",
                  "return_text_in_logprobs", "rid", "cache_salt", "extra_key", "return_prompt_token_ids",
                  "session_params", "bootstrap_host", "bootstrap_port", "bootstrap_room", "bootstrap_pair_key")


def build_scheduler(args: ServerArgs, faults=None):
    """Load the model and build the scheduler around it (used by Engine and the server's child).
    `faults`: a scheduler.faults.FaultInjector, for tests only."""
    from lmprog_runtime.model_executor.runner import ModelRunner
    from lmprog_runtime.scheduler.scheduler import Scheduler

    runner = ModelRunner(args)

    def grammar_factory():  # built on the first constrained request: vocab indexing costs seconds
        from lmprog_runtime.constrained import create_serving_backend
        cfg = runner.model_config
        return create_serving_backend(
            args.grammar_backend, runner.tokenizer, cfg.vocab_size, cfg.eos_token_ids,
            whitespace_pattern=args.constrained_json_whitespace_pattern)

    use_grammars = args.grammar_backend != "none"
    from lmprog_runtime import gc_tuning

    gc_tuning.monitor(args.gc_warning_threshold_secs)  # collections counted and timed from here on
    return Scheduler(args, runner, grammar_factory=grammar_factory if use_grammars else None, faults=faults)


def model_info(args: ServerArgs, runner) -> Dict[str, Any]:
    """SGLang's /model_info. `model_path` is what a client can load the model by: the Hugging
    Face id of the embedded default, else the resolved local path; `tokenizer_path` a folder
    with `tokenizer.json` where one exists (a GGUF's converted tokenizer)."""
    cfg = runner.model_config
    tok = runner.tokenizer
    tokenizer_source = resolve_model_path(args.tokenizer_path or args.model_path)
    return {
        "model_path": DEFAULT_MODEL_ID if args.model_path == DEFAULT_MODEL else runner.model_path,
        "served_model_name": args.served_model_name or _model_name(args.model_path),
        "tokenizer_path": tokenizer_folder_if_ready(tokenizer_source),
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "reasoning_parser": None,
        "tool_call_parser": None,
        "model_type": cfg.architecture,
        "architectures": [_HF_ARCHITECTURES.get(cfg.architecture, cfg.architecture)],
        "context_length": args.context_length or cfg.context_length,
        "vocab_size": cfg.vocab_size,
        "chat_template": args.chat_template or getattr(tok, "chat_template", None),
        "eos_token_ids": list(cfg.eos_token_ids),
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _model_name(model_path: str) -> str:
    import os
    if model_path == "default":
        return "SmolLM2-135M-Instruct"
    return os.path.basename(os.path.normpath(model_path)).removesuffix(".gguf")


class Engine:
    def __init__(self, faults=None, **kwargs):
        """`kwargs`: ServerArgs fields. `faults`: a FaultInjector (scheduler/faults.py), tests only."""
        self.server_args = ServerArgs.from_kwargs(**kwargs)
        if self.server_args.dp_size != 1:  # replicas are processes; the Engine runs one in-process
            raise ValueError(f"dp_size: the in-process Engine runs one scheduler; got {self.server_args.dp_size}, "
                             "expected 1 (use `lmprog-runtime serve --dp-size N` for replicas).")
        self.scheduler = build_scheduler(self.server_args, faults)
        runner = self.scheduler.runner
        self.tokenizer = runner.tokenizer
        self._model_info = model_info(self.server_args, runner)
        self._inbox: "queue.Queue" = queue.Queue()
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, name="lmprog-engine-loop",
                                             daemon=True)
        self._loop_thread.start()
        self.tm = TokenizerManager(self.tokenizer, runner.model_config.vocab_size,
                                   self.scheduler.context_len, send=self._inbox.put,
                                   incremental_streaming=self.server_args.incremental_streaming_output)
        self._sched_thread = threading.Thread(target=self._run_scheduler, name="lmprog-scheduler",
                                              daemon=True)
        self._sched_thread.start()
        self._closed = False

    # -- scheduler thread ---------------------------------------------------------------------
    def _recv(self, block: bool) -> List[Any]:
        msgs = []
        try:
            msgs.append(self._inbox.get(block=block, timeout=0.5 if block else None))
        except queue.Empty:
            return msgs
        while True:
            try:
                msgs.append(self._inbox.get_nowait())
            except queue.Empty:
                return msgs

    def _deliver(self, obj) -> None:
        self.loop.call_soon_threadsafe(self.tm.handle_output, obj)

    def _run_scheduler(self) -> None:
        try:
            self.scheduler.run_forever(self._recv, self._deliver)
        except Exception as e:  # fail every open request instead of hanging
            logger.exception("scheduler crashed")
            self.loop.call_soon_threadsafe(self.tm.fail_all, f"{type(e).__name__}: {e}")

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # -- public API -----------------------------------------------------------------------
    def generate(self, prompt: Union[str, List[str], None] = None, sampling_params: Optional[Union[dict, list]] = None,
                 input_ids: Optional[list] = None, stream: bool = False, **kwargs):
        """SGLang-shaped result dict (list for a batch), or an iterator of cumulative chunks."""
        obj = self._request(prompt, sampling_params, input_ids, stream, kwargs)
        if not stream:
            return self._call(self.tm.generate(obj))
        return self._iterate(self.tm.generate_stream(obj))

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, stream: bool = False,
                             **kwargs):
        obj = self._request(prompt, sampling_params, input_ids, stream, kwargs)
        if not stream:
            return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.tm.generate(obj), self.loop))
        return self._aiterate(self.tm.generate_stream(obj))

    @staticmethod
    def _request(prompt, sampling_params, input_ids, stream, kwargs) -> dict:
        unknown = sorted(set(kwargs) - set(_GENERATE_KEYS))
        if unknown:
            raise TypeError(f"generate() got unexpected keyword argument(s): {', '.join(unknown)}")
        obj = {"sampling_params": sampling_params, "stream": stream}
        if input_ids is not None:
            obj["input_ids"] = input_ids
        else:
            obj["text"] = prompt
        obj.update({k: v for k, v in kwargs.items() if v is not None})
        return obj

    def _iterate(self, agen) -> Iterator[dict]:
        try:
            while True:
                try:
                    yield self._call(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:
            self._call(agen.aclose())

    async def _aiterate(self, agen) -> AsyncIterator[dict]:
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), self.loop)
                try:
                    yield await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
        finally:
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(agen.aclose(), self.loop))

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.loop.call_soon_threadsafe(self.tm.abort, rid, abort_all)

    def flush_cache(self) -> dict:
        reply = self._call(self.tm.control("flush_cache"))
        return {"success": reply.success, "message": reply.message}

    def freeze_gc(self) -> dict:
        """Collect, then freeze this process's live objects (gc_tuning.py; the Engine never does
        it on its own: the surrounding program's objects are frozen too)."""
        reply = self._call(self.tm.control("freeze_gc"))
        return {"success": reply.success, "message": reply.message, **reply.data}

    def get_internal_state(self) -> dict:
        return self._call(self.tm.control("internal_state")).data

    def inspect_state(self, max_nodes: int = INSPECT_MAX_NODES_DEFAULT, include_tree: bool = True) -> dict:
        """The Inspector's snapshot (what /inspect/state answers; docs/inspector.md)."""
        if self.server_args.disable_inspector:
            raise RuntimeError("the Inspector is off (disable_inspector=True)")
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) \
                or not 1 <= max_nodes <= INSPECT_MAX_NODES_CAP:
            raise ValueError(f"max_nodes: expected an integer in [1, {INSPECT_MAX_NODES_CAP}], got {max_nodes!r}")
        reply = self._call(self.tm.control("inspect", msg=InspectReq(max_nodes, bool(include_tree))))
        if not reply.success:
            raise RuntimeError(reply.message)
        return reply.data

    def get_model_info(self) -> dict:
        return {**self._model_info, "weight_version": self.tm.weight_version}

    def encode(self, prompt: Union[str, List[str], List[int], List[List[int]]]):
        """Embeddings (SGLang's Engine.encode): {"embedding", "meta_info"}, a list for a batch."""
        from lmprog_runtime.messages import EmbedReq

        batch = isinstance(prompt, list) and prompt and not isinstance(prompt[0], int)
        items = prompt if batch else [prompt]
        ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in items]
        reply = self._call(self.tm.control("embed", 300.0, EmbedReq(ids, self.server_args.embedding_pooling)))
        if not reply.success:
            raise RuntimeError(f"embedding failed: {reply.message}")
        out = [{"embedding": v, "meta_info": {"prompt_tokens": len(p)}}
               for v, p in zip(reply.data["embeddings"], ids)]
        return out if batch else out[0]

    # -- RL hooks and sessions (docs/http_api.md) ------------------------------------------
    def update_weights_from_disk(self, model_path: str, weight_version: Optional[str] = None) -> dict:
        """Load new weights in place (only while idle); flushes the prefix cache."""
        return self._control(UpdateWeightsReq(model_path, weight_version), timeout=600.0)

    def release_memory_occupation(self, tags: Optional[List[str]] = None) -> dict:
        return self._control(MemoryOccupationReq(True, tuple(tags or MEMORY_TAGS)), timeout=120.0)

    def resume_memory_occupation(self, tags: Optional[List[str]] = None) -> dict:
        return self._control(MemoryOccupationReq(False, tuple(tags or MEMORY_TAGS)), timeout=600.0)

    def get_weight_version(self) -> str:
        return self.tm.weight_version

    def attach_hicache_storage_backend(self, hicache_storage_backend: str,
                                       hicache_storage_backend_extra_config_json: Optional[str] = None,
                                       hicache_storage_prefetch_policy: Optional[str] = None,
                                       hicache_storage_dir: Optional[str] = None) -> dict:
        """Attach HiCache's L3 storage backend at run time (idle only; docs/hicache.md)."""
        return self._control(HiCacheStorageReq("attach", hicache_storage_backend,
                                               hicache_storage_backend_extra_config_json,
                                               hicache_storage_prefetch_policy, hicache_storage_dir),
                             timeout=STORAGE_ATTACH_TIMEOUT_S)

    def detach_hicache_storage_backend(self) -> dict:
        return self._control(HiCacheStorageReq("detach"), timeout=STORAGE_ATTACH_TIMEOUT_S)

    def hicache_storage_backend_status(self) -> dict:
        return self._control(HiCacheStorageReq("status"), timeout=30.0)

    def _control(self, msg, timeout: float) -> dict:
        reply = self._call(self.tm.control(msg.kind, timeout, msg))
        return {"success": reply.success, "message": reply.message, **reply.data}

    def open_session(self, capacity_of_str_len: int = 0, session_id: Optional[str] = None) -> str:
        return self._call(self._in_loop(self.tm.sessions.open, capacity_of_str_len, session_id))

    def close_session(self, session_id: str) -> None:
        self._call(self._in_loop(self.tm.sessions.close, session_id))

    @staticmethod
    async def _in_loop(fn, *args):  # the session store belongs to the tokenizer manager's loop
        return fn(*args)

    def get_server_info(self) -> dict:
        info = self.server_args.to_dict()
        info["internal_states"] = [self.get_internal_state()]
        info["version"] = __version__
        return info

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Block until the scheduler has no work (tests use this before auditing the pool)."""
        import time
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.get_internal_state()
            if state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0:
                return
            time.sleep(0.01)
        raise TimeoutError("the scheduler did not go idle")

    def check_integrity(self) -> None:
        """Audit the KV accounting (only meaningful when idle)."""
        self.wait_idle()
        state = self.get_internal_state()
        assert state["integrity"] == "ok", state["integrity"]

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._inbox.put(None)
        self._sched_thread.join(timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=10)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self):
        try:
            self.shutdown()
        except Exception:
            pass
