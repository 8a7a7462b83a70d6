"""Backends: where a program's model calls go. Each imports its heavy client only when constructed."""

from lmprog.backends.base import BaseBackend
from lmprog.backends.engine import EngineBackend
from lmprog.backends.native import NativeBackend
from lmprog.backends.openai import OpenAI
from lmprog.backends.runtime_endpoint import RuntimeEndpoint

__all__ = ["BaseBackend", "NativeBackend", "RuntimeEndpoint", "EngineBackend", "OpenAI"]
