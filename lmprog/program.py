"""`@function` programs: `run`, `run_batch`, `bind`, `trace`, `cache`, and how they execute."""

from __future__ import annotations

import inspect
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Union

from lmprog.global_config import global_config
from lmprog.interpreter import StreamExecutor
from lmprog.ir import DEFAULT_SAMPLING_PARAMS, SamplingParams
from lmprog.state import ProgramState
from lmprog.tracer import TracingScope, extract_prefix_by_tracing, trace_program

# The sampling keywords of `run` and `run_batch` and their defaults (SGLang's), defined once;
# both functions show them in their signatures (`_with_sampling_keywords`).
RUN_SAMPLING_DEFAULTS: Dict[str, Any] = {
    "max_new_tokens": 128, "n": 1, "stop": None, "stop_token_ids": None, "stop_regex": None,
    "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
    "presence_penalty": 0.0, "ignore_eos": False, "return_logprob": None, "logprob_start_len": None,
    "top_logprobs_num": None, "return_text_in_logprobs": None,
}
_BATCH_CHUNK = 200


class SglFunction:
    """A program: a Python function whose first parameter is the state `s`."""

    def __init__(self, func: Callable, num_api_spec_tokens: Optional[int] = None,
                 bind_arguments: Optional[Dict[str, Any]] = None):
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        spec = inspect.getfullargspec(func)
        if not spec.args or spec.args[0] != "s":
            raise TypeError(f"the first parameter of an lmprog function must be named 's', "
                            f"got {spec.args[:1] or 'none'} in {func.__name__}.")
        self.arg_names: List[str] = spec.args[1:]
        self.arg_defaults = spec.defaults or ()
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = getattr(func, "__doc__", None)

    def bind(self, **kwargs) -> "SglFunction":
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"bind() got unknown arguments {unknown}; {self.__name__} takes {self.arg_names}.")
        return SglFunction(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    # --- running --------------------------------------------------------------------------
    def run(self, *args, stream: bool = False, backend=None, use_thread: bool = True,
            **kwargs) -> ProgramState:
        """Run the program; keywords named in RUN_SAMPLING_DEFAULTS set its sampling
        defaults, every other keyword is a program argument."""
        sampling, kwargs = _split_sampling(kwargs)
        if self.num_api_spec_tokens is not None and stream:
            raise ValueError("num_api_spec_tokens cannot be combined with stream=True.")
        return run_program(self, backend or global_config.default_backend, args, kwargs, _defaults(sampling),
                           stream=stream, use_thread=use_thread)

    def run_batch(self, batch_kwargs, *, backend=None, num_threads: Union[str, int] = "auto",
                  progress_bar: bool = False, generator_style: bool = False, **sampling):
        sampling, unknown = _split_sampling(sampling)
        if unknown:
            raise TypeError(f"run_batch() got unexpected keyword argument(s): {', '.join(sorted(unknown))}")
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError(f"run_batch expects a list of argument dicts, got {type(batch_kwargs).__name__}.")
        if not batch_kwargs:
            return []
        batch = [self._arguments_of(item) for item in batch_kwargs]
        return run_program_batch(self, backend or global_config.default_backend, batch, _defaults(sampling),
                                 num_threads, progress_bar, generator_style)

    def _arguments_of(self, item) -> Dict[str, Any]:
        if isinstance(item, dict):
            return dict(item)
        required = len(self.arg_names) - len(self.arg_defaults)
        if not isinstance(item, (list, tuple)) or not required <= len(item) <= len(self.arg_names):
            raise TypeError(f"Given arguments mismatch the SGL function signature: {self.__name__} takes "
                            f"{self.arg_names}, got {item!r}.")
        return dict(zip(self.arg_names, item))

    def trace(self, *, backend=None, **kwargs):
        return trace_program(self, kwargs, backend or global_config.default_backend)

    def cache(self, backend=None):
        return cache_program(self, backend or global_config.default_backend)

    def __call__(self, *args, **kwargs):
        scope = TracingScope.get_current_scope()
        if scope is None:
            return self.run(*args, **kwargs)
        return self.trace(backend=scope.tracer_state.backend, **kwargs)

    def __repr__(self):
        return f"SglFunction({self.__name__})"


def _split_sampling(kwargs: Dict[str, Any]):
    """(sampling keywords, the rest)."""
    sampling = {k: v for k, v in kwargs.items() if k in RUN_SAMPLING_DEFAULTS}
    return sampling, {k: v for k, v in kwargs.items() if k not in RUN_SAMPLING_DEFAULTS}


def _with_sampling_keywords(fn: Callable, keep_var_keyword: bool) -> None:
    """Show RUN_SAMPLING_DEFAULTS as keyword-only parameters in `fn`'s signature (its
    `**kwargs` stays only where it also takes other keywords: run's program arguments)."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind != p.VAR_KEYWORD]
    at = next((i for i, p in enumerate(params) if p.kind == p.KEYWORD_ONLY), len(params))
    extra = [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in RUN_SAMPLING_DEFAULTS.items()]
    tail = [p for p in sig.parameters.values() if p.kind == p.VAR_KEYWORD and keep_var_keyword]
    fn.__signature__ = sig.replace(parameters=params[:at] + extra + params[at:] + tail)


_with_sampling_keywords(SglFunction.run, keep_var_keyword=True)
_with_sampling_keywords(SglFunction.run_batch, keep_var_keyword=False)


def _defaults(sampling: Dict[str, Any]) -> SamplingParams:
    values = {**RUN_SAMPLING_DEFAULTS, **sampling}
    for k in ("stop", "stop_token_ids", "stop_regex"):
        values[k] = values[k] if values[k] is not None else ()
    return DEFAULT_SAMPLING_PARAMS.merged(SamplingParams(**values))


def _unwrap(backend):
    if backend is None:
        raise ValueError("No backend: pass backend=... or call lmprog.set_default_backend(...) first.")
    return backend.endpoint if hasattr(backend, "endpoint") else backend


def run_program(program: SglFunction, backend, func_args, func_kwargs, default_sampling_para,
                stream: bool = False, sync: bool = False, use_thread: bool = True) -> ProgramState:
    backend = _unwrap(backend)
    func_kwargs = {**func_kwargs, **program.bind_arguments}
    executor = StreamExecutor(backend, func_kwargs, default_sampling_para, chat_template=None, stream=stream,
                              num_api_spec_tokens=program.num_api_spec_tokens, use_thread=use_thread)
    state = ProgramState(executor)
    if stream:
        threading.Thread(target=_run_in_background, args=(program, state, func_args, func_kwargs),
                         name="lmprog-program").start()
        return state
    _run_function(program, state, func_args, func_kwargs)
    if sync:
        state.sync()
    if global_config.verbosity >= 2:
        print(state.text())
    return state


def _run_function(program, state: ProgramState, func_args, func_kwargs) -> None:
    executor = state.stream_executor
    executor.backend.begin_program(executor)
    try:
        state.ret_value = program.func(state, *func_args, **func_kwargs)
    finally:
        executor.mark_program_finished()
        executor.end()


def _run_in_background(program, state: ProgramState, func_args, func_kwargs) -> None:
    try:
        _run_function(program, state, func_args, func_kwargs)
    except Exception as e:  # the program itself failed: record it like a failed model call
        state.stream_executor.record_error(e)


def cache_program(program: SglFunction, backend) -> Optional[str]:
    """Warm the server's prefix cache with the program's constant prefix; returns it if sent."""
    backend = _unwrap(backend)
    prefix = extract_prefix_by_tracing(program, backend)
    if prefix and len(prefix) > global_config.precache_min_prefix_chars:
        backend.cache_prefix(prefix)
        return prefix
    return None


def _resolve_num_threads(num_threads, batch_size: int) -> int:
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    if not isinstance(num_threads, int) or num_threads < 1:
        raise ValueError(f"num_threads must be 'auto' or a positive int, got {num_threads!r}.")
    return min(num_threads, batch_size)


def run_program_batch(program: SglFunction, backend, batch_arguments: List[Dict[str, Any]],
                      default_sampling_para, num_threads="auto", progress_bar: bool = False,
                      generator_style: bool = False):
    backend = _unwrap(backend)
    if global_config.enable_precache_with_tracing and len(batch_arguments) > 1:
        cache_program(program, backend)
    num_threads = _resolve_num_threads(num_threads, len(batch_arguments))

    def one(arguments):
        return run_program(program, backend, (), arguments, default_sampling_para, stream=False, sync=True)

    if generator_style:
        return _run_batch_generator(one, batch_arguments, num_threads, progress_bar)
    bar = _progress(progress_bar, len(batch_arguments))
    try:
        if num_threads == 1:
            states = []
            for arguments in batch_arguments:
                states.append(one(arguments))
                bar and bar.update(1)
            return states
        with ThreadPoolExecutor(num_threads, thread_name_prefix="lmprog-batch") as pool:
            futures = [pool.submit(one, arguments) for arguments in batch_arguments]
            if bar:
                for f in futures:
                    f.add_done_callback(lambda _: bar.update(1))
            return [f.result() for f in futures]
    finally:
        bar and bar.close()


def _run_batch_generator(one, batch_arguments, num_threads, progress_bar: bool):
    """States in input order as they finish; the bar (if any) counts the states yielded."""
    bar = _progress(progress_bar, len(batch_arguments))
    try:
        for state in _batch_states(one, batch_arguments, num_threads):
            bar and bar.update(1)
            yield state
    finally:
        bar and bar.close()


def _batch_states(one, batch_arguments, num_threads):
    if num_threads == 1:
        for arguments in batch_arguments:
            yield one(arguments)
        return
    with ThreadPoolExecutor(num_threads, thread_name_prefix="lmprog-batch") as pool:
        for start in range(0, len(batch_arguments), _BATCH_CHUNK):
            futures = [pool.submit(one, a) for a in batch_arguments[start:start + _BATCH_CHUNK]]
            for f in futures:
                yield f.result()


def _progress(enabled: bool, total: int):
    if not enabled:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total)
