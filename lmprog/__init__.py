"""lmprog: a Python-embedded language for LLM programs.

SGLang's frontend surface: a program written for SGLang runs with `import lmprog as sgl`.
Pure Python; the runtime (and torch) is imported only when an in-process `Engine` is built.
"""

from lmprog.api import (assistant, assistant_begin, assistant_end, flush_cache, function, gen, gen_int,
                        gen_string, get_server_info, image, select, separate_reasoning, set_default_backend,
                        system, system_begin, system_end, user, user_begin, user_end, video)
from lmprog.backends import BaseBackend, EngineBackend, OpenAI, RuntimeEndpoint
from lmprog.chat_template import ChatTemplate, get_chat_template, register_chat_template
from lmprog.choices import greedy_token_selection, token_length_normalized, unconditional_likelihood_normalized
from lmprog.global_config import global_config
from lmprog.interpreter import ProgramError
from lmprog.ir import SamplingParams
from lmprog.offline import Engine, Runtime
from lmprog.program import SglFunction
from lmprog.state import ProgramState, ProgramStateGroup

__version__ = "0.1.0"

__all__ = [
    "function", "gen", "gen_int", "gen_string", "select", "image", "video", "separate_reasoning",
    "system", "system_begin", "system_end", "user", "user_begin", "user_end",
    "assistant", "assistant_begin", "assistant_end",
    "set_default_backend", "flush_cache", "get_server_info", "global_config",
    "RuntimeEndpoint", "Runtime", "Engine", "EngineBackend", "OpenAI", "BaseBackend",
    "greedy_token_selection", "token_length_normalized", "unconditional_likelihood_normalized",
    "ChatTemplate", "get_chat_template", "register_chat_template",
    "ProgramState", "ProgramStateGroup", "ProgramError", "SamplingParams", "SglFunction",
]
