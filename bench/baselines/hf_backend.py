"""An lmprog backend over Hugging Face `transformers`: the program workloads without a server.

Each `gen` is one `model.generate` call on the whole prompt so far (no KV reuse between
calls or programs), `select` one padded forward pass over `prompt + choice` for all
choices. What a plain-Python script would do; it runs one model call at a time (a lock),
so `run_batch(num_threads=1)` is "HF sequential".

Constraints are not supported: `regex` / `json_schema` are ignored (the gen is
unconstrained, with the same `max_tokens` and stops) and counted in `unconstrained_calls`;
the benchmark reports how many outputs still parse.
"""

from __future__ import annotations

import threading
from typing import List, Optional

from lmprog.backends.base import BaseBackend
from lmprog.chat_template import chat_template_for_model
from lmprog.choices import ChoicesDecision, ChoicesSamplingMethod, token_length_normalized
from lmprog.ir import SamplingParams

from bench.baselines.hf_generate import load_hf_model


class HFTransformers(BaseBackend):
    def __init__(self, model_path: str = "default", dtype: str = "float32", num_threads: Optional[int] = None):
        super().__init__()
        self.model, self.tokenizer = load_hf_model(model_path, dtype, num_threads)
        self.chat_template = chat_template_for_model(
            {"chat_template": self.tokenizer.chat_template, "model_path": "SmolLM2-135M-Instruct"})
        self.lock = threading.Lock()
        self.unconstrained_calls = 0
        self.prompt_tokens = 0

    def get_model_name(self) -> str:
        return "hf-transformers"

    def generate(self, s, sampling_params: SamplingParams):
        import torch

        sp = sampling_params
        if sp.regex is not None or sp.json_schema is not None:
            self.unconstrained_calls += 1
        temperature = sp.temperature if sp.temperature is not None else 1.0
        kwargs = {"max_new_tokens": sp.max_new_tokens or 128, "do_sample": temperature > 1e-6,
                  "pad_token_id": self.tokenizer.pad_token_id}
        if kwargs["do_sample"]:
            kwargs.update(temperature=temperature, top_p=sp.top_p or 1.0)
        if sp.stop:
            kwargs.update(stop_strings=list(sp.stop), tokenizer=self.tokenizer)
        if sp.ignore_eos:
            kwargs["min_new_tokens"] = kwargs["max_new_tokens"]
        with self.lock:
            enc = self.tokenizer(s.text_, return_tensors="pt")
            with torch.inference_mode():
                out = self.model.generate(**enc, **kwargs)
        new_ids = out[0, enc["input_ids"].shape[1]:].tolist()
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        for stop in sp.stop or ():
            if stop in text:
                text = text[:text.index(stop)]
        self.prompt_tokens += enc["input_ids"].shape[1]
        return text, {"prompt_tokens": enc["input_ids"].shape[1], "completion_tokens": len(new_ids),
                      "cached_tokens": 0}

    def select(self, s, choices: List[str], temperature: float,
               choices_method: Optional[ChoicesSamplingMethod] = None) -> ChoicesDecision:
        import torch

        method = choices_method or token_length_normalized
        if method.requires_unconditional_logprobs:
            raise NotImplementedError(f"{method} is not supported by the HF baseline.")
        context_len = len(self.tokenizer(s.text_)["input_ids"])
        with self.lock:
            enc = self.tokenizer([s.text_ + c for c in choices], return_tensors="pt", padding=True)
            with torch.inference_mode():
                logprobs = torch.log_softmax(self.model(**enc).logits.float(), dim=-1)
        entries = []
        ids, mask = enc["input_ids"], enc["attention_mask"]
        width = ids.shape[1]
        for row in range(len(choices)):
            pad = width - int(mask[row].sum())  # left padding
            positions = range(pad + context_len, width)  # the choice's tokens (context tokenized alone)
            entries.append([[float(logprobs[row, p - 1, ids[row, p]]), int(ids[row, p]), None] for p in positions])
        self.prompt_tokens += int(mask.sum())
        normalized = [sum(e[0] for e in es) / len(es) if es else float("-inf") for es in entries]
        return method(choices=choices, normalized_prompt_logprobs=normalized, input_token_logprobs=entries,
                      output_token_logprobs=[[] for _ in choices])
