"""A model's tokenizer for the server process: `tokenizers` + jinja2, no torch, no transformers.

`Tokenizer.from_folder` reads `tokenizer.json`, `tokenizer_config.json` (+ the legacy
`special_tokens_map.json`) and the chat template (`chat_template.jinja`,
`chat_template.json`, `additional_chat_templates/*.jinja` or the config's entry), and sets
the backend up as transformers' `TokenizersBackend` does: named special tokens missing from
the vocabulary are added as special, `tokenizer.json`'s post-processor is kept, no
truncation or padding. `encode`, `decode` and `apply_chat_template`
then give the same ids and text as the transformers tokenizer of the same folder (tested in
`tests/runtime/test_tokenizer.py`). The scheduler process keeps the transformers tokenizer:
the grammar backends need it.
"""

from __future__ import annotations

import glob
import json
import os
from typing import Any, Dict, List, Optional, Sequence, Union

from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from lmprog_runtime import chat_template as ct
from lmprog_runtime.model_paths import convert_in_child, is_gguf, resolve_model_path, tokenizer_folder

# transformers' named special tokens, the ones a chat template sees as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Where a config lists special tokens beyond the named ones (new name, legacy name).
_EXTRA_SPECIAL_KEYS = ("extra_special_tokens", "additional_special_tokens")
# transformers' `clean_up_tokenization` (applied only when the config asks, never for BPE).
_CLEANUP = ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
            (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"))


def load_tokenizer(model_path: str) -> "Tokenizer":
    """The tokenizer of a model path as the server takes it ("default", a folder, a .gguf)."""
    path = resolve_model_path(model_path)
    folder = tokenizer_folder(path)
    try:
        return Tokenizer.from_folder(folder)
    except Exception as e:
        if not is_gguf(path):
            raise ValueError(f"model {path!r}: cannot load its tokenizer from {folder!r}: {e}") from e
    folder = convert_in_child(path)  # a stale or partial conversion cache: the child rebuilds it
    try:
        return Tokenizer.from_folder(folder)
    except Exception as e:
        raise ValueError(f"model {path!r}: cannot load its tokenizer from {folder!r}: {e}") from e


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_text(value) -> Optional[str]:
    """A special token as saved: a string, or an AddedToken dict with "content"."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _read_chat_templates(folder: str, config: dict) -> Union[None, str, Dict[str, str]]:
    """transformers' order: the config's entry, replaced by the template files when present."""
    templates = config.get("chat_template")
    if isinstance(templates, list):  # [{"name": ..., "template": ...}]
        templates = {t["name"]: t["template"] for t in templates}
    files: Dict[str, str] = {}
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file, encoding="utf-8") as f:
            files["default"] = f.read()
    elif "chat_template" in (legacy := _read_json(os.path.join(folder, "chat_template.json"))):
        files["default"] = legacy["chat_template"]
    for extra in sorted(glob.glob(os.path.join(folder, "additional_chat_templates", "*.jinja"))):
        with open(extra, encoding="utf-8") as f:
            files[os.path.basename(extra)[:-len(".jinja")]] = f.read()
    if list(files) == ["default"]:
        return files["default"]
    return files or templates


class Tokenizer:
    """The server side's tokenizer: the subset of a transformers tokenizer that
    `TokenizerManager`, `SamplingParams.normalize` and the HTTP handlers use."""

    def __init__(self, backend: Backend, config: dict, chat_template: Union[None, str, Dict[str, str]]):
        self.backend = backend
        self.config = config
        self.chat_template = chat_template
        self.special_tokens_map: Dict[str, str] = {
            name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and (
            type(backend.model).__name__ != "BPE"
            or bool(config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")))
        self._setup_backend()

    @classmethod
    def from_folder(cls, folder: str) -> "Tokenizer":
        config = _read_json(os.path.join(folder, "tokenizer_config.json"))
        if "added_tokens_decoder" not in config:  # legacy layout: the map fills in the names
            for name, value in _read_json(os.path.join(folder, "special_tokens_map.json")).items():
                if name in SPECIAL_TOKEN_NAMES or name in _EXTRA_SPECIAL_KEYS:
                    config[name] = value
        backend = Backend.from_file(os.path.join(folder, "tokenizer.json"))
        return cls(backend, config, _read_chat_templates(folder, config))

    def _setup_backend(self) -> None:
        b = self.backend
        b.no_truncation()
        b.no_padding()
        b.encode_special_tokens = bool(self.config.get("split_special_tokens", False))
        added = {t.content for t in b.get_added_tokens_decoder().values()}
        missing = [AddedToken(t, special=True) for t in self.all_special_tokens if t not in added]
        if missing:
            b.add_special_tokens(missing)
        # The post-processor (bos/eos around a text) is tokenizer.json's own: transformers 5
        # does not rebuild it from the config's add_bos_token/add_eos_token either (tested).

    # -- vocabulary ---------------------------------------------------------------------------
    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary without added tokens (transformers' `vocab_size`)."""
        return self.backend.get_vocab_size(with_added_tokens=False)

    def get_vocab(self) -> Dict[str, int]:
        """token -> id, added tokens included (transformers' `get_vocab`)."""
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, ids: Union[int, Sequence[int]]):
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def _named_id(self, name: str) -> Optional[int]:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend.token_to_id(text)

    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    pad_token = property(lambda self: self.special_tokens_map.get("pad_token"))
    bos_token_id = property(lambda self: self._named_id("bos_token"))
    eos_token_id = property(lambda self: self._named_id("eos_token"))
    pad_token_id = property(lambda self: self._named_id("pad_token"))

    @property
    def all_special_tokens(self) -> List[str]:
        """The named special tokens, then the config's extra ones, each once (transformers' order)."""
        extra = [_token_text(t) for key in _EXTRA_SPECIAL_KEYS if isinstance(self.config.get(key), list)
                 for t in self.config[key]]
        return list(dict.fromkeys([*self.special_tokens_map.values(), *(t for t in extra if t is not None)]))

    @property
    def all_special_ids(self) -> List[int]:
        return [self.backend.token_to_id(t) for t in self.all_special_tokens]

    # -- text <-> ids -------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> List[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Union[int, Sequence[int]], skip_special_tokens: bool = False, **_ignored: Any) -> str:
        """`_ignored`: transformers' slow-tokenizer options (`spaces_between_special_tokens`),
        which a `tokenizer.json` tokenizer ignores too."""
        text = self.backend.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up:
            for old, new in _CLEANUP:
                text = text.replace(old, new)
        return text

    def apply_chat_template(self, conversation: List[dict], tools: Optional[list] = None,
                            documents: Optional[list] = None, chat_template: Optional[str] = None,
                            add_generation_prompt: bool = False, continue_final_message: Union[bool, str] = False,
                            tokenize: bool = True, **kwargs) -> Union[str, List[int]]:
        """The conversation through the chat template: text, or (`tokenize`) its ids encoded
        without added special tokens, as transformers does."""
        source = ct.select_template(self.chat_template, chat_template, tools)
        text = ct.render(source, conversation, tools=tools, documents=documents,
                         add_generation_prompt=add_generation_prompt,
                         continue_final_message=continue_final_message, **{**self.special_tokens_map, **kwargs})
        return self.encode(text, add_special_tokens=False) if tokenize else text
