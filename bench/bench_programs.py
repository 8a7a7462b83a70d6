"""Program workloads through the DSL, after the SGLang paper's benchmarks.

    python bench/bench_programs.py --backend lmprog --port 30000 --workload mmlu
    python bench/bench_programs.py --backend oai --base-url http://127.0.0.1:8001 --workload json --oai-grammar gbnf
    python bench/bench_programs.py --backend hf --workload chat --num-programs 8 --parallel 1

Workloads (synthetic data from `bench/workloads.py`, nothing downloaded):
- `mmlu`       5-shot multiple choice, one decoded token (`gen(max_tokens=1)`); the 5-shot
               prefix is shared by every question of a subject.
- `hellaswag`  few-shot context + `select` among four endings.
- `tot`        tree of thought: 3 plans with `fork`, each checked by 2 more branches, then
               `select` of the best plan (9 gens of fixed length + 1 select per program).
- `json`       JSON extraction with `gen(json_schema=...)`.
- `chat`       two-turn chat over a shared handbook system prompt (fixed-length answers).
Backends: `lmprog` = `sgl.RuntimeEndpoint` (the native API); `oai` = `sgl.OpenAI` as a
completion model against `/v1/completions` (llama.cpp's server: with `--oai-grammar gbnf`
the JSON schema travels as a llama.cpp GBNF grammar); `hf` = transformers in-process
(`bench/baselines/hf_backend.py`, one model call at a time). Every backend runs the same
program functions on the same arguments. Reports programs/s, model calls, a quality
signal (accuracy vs the synthetic answer key, or the share of outputs that parse) and the
server's prefix-cache hit rate over the run and over time.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lmprog as sgl  # noqa: E402
from bench.workloads import (chat_turns, handbook, hellaswag_items, mmlu_items, people_sentences,  # noqa: E402
                             reasoning_problems)

PERSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
    "city": {"type": "string", "maxLength": 12}}, "required": ["name", "age", "city"]}


# --- the programs --------------------------------------------------------------------------------

@sgl.function
def mmlu(s, shots, question):
    s += shots + question
    s += sgl.gen("answer", max_tokens=1, temperature=0)


@sgl.function
def hellaswag(s, shots, context, endings):
    s += shots + context
    s += sgl.select("answer", endings)


@sgl.function
def tree_of_thought(s, problem):
    s += "Solve the problem by comparing plans. Keep every line short.\nProblem: " + problem + "\n"
    plans = s.fork(3)
    for i, f in enumerate(plans):
        f += f"Plan {i + 1}:" + sgl.gen("plan", max_tokens=24, temperature=0, ignore_eos=True) + "\n"
    for f in plans:
        checks = f.fork(2)
        checks += lambda j: ["Main risk:", "Main benefit:"][j]
        for c in checks:
            c += sgl.gen("check", max_tokens=16, temperature=0, ignore_eos=True)
        checks.join()
    plans.join()
    for i, plan in enumerate(plans):
        s += f"Plan {i + 1}: {plan['plan'].strip().split(chr(10))[0]}\n"
    s += "The best plan is Plan" + sgl.select("best", [" 1", " 2", " 3"])


@sgl.function
def json_extract(s, sentence):
    s += ("Extract the person described in the text as JSON with the fields name, age and city.\n"
          "Text: Mia is 29 years old and lives in Rome.\n"
          'JSON: {"name": "Mia", "age": 29, "city": "Rome"}\n'
          "Text: " + sentence + "\nJSON: ")
    s += sgl.gen("person", max_tokens=48, temperature=0, json_schema=json.dumps(PERSON_SCHEMA))


@sgl.function
def multi_turn_chat(s, document, question_1, question_2):
    s += sgl.system("You answer questions about this handbook, briefly.\n" + document)
    s += sgl.user(question_1)
    s += sgl.assistant(sgl.gen("answer_1", max_tokens=32, temperature=0, ignore_eos=True))
    s += sgl.user(question_2)
    s += sgl.assistant(sgl.gen("answer_2", max_tokens=32, temperature=0, ignore_eos=True))


# --- data and scoring per workload ---------------------------------------------------------------

def _mmlu_text(item, with_answer: bool) -> str:
    options = "".join(f"{l}. {o}\n" for l, o in zip("ABCD", item["options"]))
    text = f"{item['context']}\nQuestion: {item['question']}\n{options}Answer:"
    return text + (f" {item['answer']}\n\n" if with_answer else "")


def mmlu_data(n, rng):
    items = mmlu_items(n, rng)
    args = [{"shots": f"The following are multiple choice questions about {it['subject']}.\n\n"
             + "".join(_mmlu_text(ex, True) for ex in it["shots"]), "question": _mmlu_text(it, False)}
            for it in items]
    return args, [it["answer"] for it in items]


def hellaswag_data(n, rng):
    shots, items = hellaswag_items(n, rng)
    prefix = "".join(ex["context"] + ex["endings"][ex["label"]] + "\n\n" for ex in shots)
    return ([{"shots": prefix, "context": it["context"], "endings": it["endings"]} for it in items],
            [it["endings"][it["label"]] for it in items])


def _accuracy(states, key):
    return sum(st["answer"].strip() == k.strip() for st, k in zip(states, key)) / len(key)


def _json_valid(states, _key):
    def ok(text):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        return isinstance(value, dict) and set(PERSON_SCHEMA["required"]) <= set(value)
    return sum(ok(st["person"]) for st in states) / len(states)


WORKLOADS = {
    # name: (program, data(n, rng) -> (arguments, key), quality(states, key), quality name, model calls per program)
    "mmlu": (mmlu, mmlu_data, _accuracy, "accuracy", 1),
    "hellaswag": (hellaswag, hellaswag_data, _accuracy, "accuracy", 1),
    "tot": (tree_of_thought, lambda n, rng: ([{"problem": p} for p in reasoning_problems(n, rng)], None),
            None, None, 10),
    "json": (json_extract, lambda n, rng: ([{"sentence": t} for t in people_sentences(n, rng)], None),
             _json_valid, "valid_json", 1),
    "chat": (multi_turn_chat, lambda n, rng: (
        [{"document": handbook(512), "question_1": a, "question_2": b} for a, b in chat_turns(n, rng)], None),
        None, None, 2),
}
DEFAULT_SIZES = {"mmlu": 64, "hellaswag": 48, "tot": 8, "json": 32, "chat": 24}


# --- backends ------------------------------------------------------------------------------------

EOS_TOKEN_IDS = ("0", "2")  # SmolLM2's <|endoftext|> and <|im_end|>


class LlamaCppCompletions(sgl.OpenAI):
    """`sgl.OpenAI` against llama.cpp's `/v1/completions`: `json_schema` is sent as a GBNF
    grammar, `ignore_eos` as a logit bias that bans the end-of-text tokens, and `select`
    scores one choice per request (the server takes a single prompt)."""

    def _kwargs(self, sp, chat):
        kwargs = super()._kwargs(sp, chat)
        if sp.ignore_eos:
            extra = dict(kwargs.get("extra_body") or {})
            extra["logit_bias"] = {t: -100.0 for t in EOS_TOKEN_IDS}
            kwargs["extra_body"] = extra
        if sp.json_schema is not None:
            from llama_cpp.llama_grammar import json_schema_to_gbnf
            extra = dict(kwargs.get("extra_body") or {})
            extra.pop("json_schema", None)
            extra["grammar"] = json_schema_to_gbnf(sp.json_schema)
            kwargs["extra_body"] = extra
        return kwargs


    def select(self, s, choices, temperature, choices_method=None):
        """llama.cpp's server takes one prompt per request: score each choice in its own request."""
        from lmprog.backends.openai import _mean, _window

        text, method = s.text_, choices_method or sgl.token_length_normalized
        entries = []
        for c in choices:
            resp = self.client.completions.create(model=self.model_name, prompt=text + c, echo=True, logprobs=1,
                                                  max_tokens=1, temperature=0)
            lp = resp.choices[0].logprobs
            entries.append(_window(lp.tokens, lp.token_logprobs, len(text), len(text + c)))
        return method(choices=choices, normalized_prompt_logprobs=[_mean([e[0] for e in es]) for es in entries],
                      input_token_logprobs=entries, output_token_logprobs=[[] for _ in choices])


def make_backend(args):
    if args.backend == "lmprog":
        return sgl.RuntimeEndpoint(args.base_url)
    if args.backend == "oai":
        cls = LlamaCppCompletions if args.oai_grammar == "gbnf" else sgl.OpenAI
        return cls(args.model, is_chat_model=False, base_url=args.base_url + "/v1", timeout=args.request_timeout)
    from bench.baselines.hf_backend import HFTransformers
    return HFTransformers(args.model_path, args.dtype, args.num_threads)


class HitRatePoller:
    """Samples the server's prefix-cache counters every `interval` s (lmprog servers only)."""

    def __init__(self, base_url: str, interval: float = 1.0):
        self.base_url, self.interval = base_url, interval
        self.samples, self._stop = [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def state(self):
        import requests
        try:
            res = requests.get(self.base_url + "/get_server_info", timeout=10)
            return (res.json().get("internal_states") or [None])[0] if res.ok else None
        except Exception:  # noqa: BLE001 — another server, another API
            return None

    def _sample(self) -> bool:
        st = self.state()
        if st is None:
            return False
        self.samples.append({"t": time.perf_counter() - self._t0, "num_prompt_tokens": st["num_prompt_tokens"],
                             "num_cached_tokens": st["num_cached_tokens"]})
        return True

    def _run(self):
        while not self._stop.wait(self.interval) and self._sample():
            pass

    def __enter__(self):
        """Samples once now (the baseline, t=0), then every `interval` s in a thread."""
        self._t0 = time.perf_counter()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def flush(backend, args):
    if args.backend == "lmprog":
        import requests
        requests.post(args.base_url + "/flush_cache", timeout=60)


def run_workload(args) -> dict:
    from bench.bench_serving import server_delta

    program, data, quality, quality_name, calls = WORKLOADS[args.workload]
    n = args.num_programs or DEFAULT_SIZES[args.workload]
    arguments, key = data(n + 1, random.Random(args.seed))
    warm_args, arguments, key = arguments[-1], arguments[:n], (key[:n] if key else None)
    backend = make_backend(args)
    program.run(**warm_args, backend=backend)  # not timed: first-call costs (grammar compile, caches)
    flush(backend, args)
    poller = HitRatePoller(args.base_url) if args.backend == "lmprog" else None
    before = poller.state() if poller else None
    t0 = time.perf_counter()
    with (poller or _Null()):  # the poller's t=0 is the start of the batch
        states = program.run_batch(arguments, backend=backend, num_threads=args.parallel,
                                   progress_bar=not args.no_progress)
        for st in states:
            st.sync()
    wall = time.perf_counter() - t0
    server = server_delta(before, poller.state()) if poller else None
    errors = [str(st.error()) for st in states if st.error() is not None]
    ok_states = [st for st in states if st.error() is None]
    result = {"programs": n, "failed": len(errors), "wall_s": wall, "programs_per_s": len(ok_states) / wall,
              "model_calls_per_program": calls, "parallel": args.parallel,
              "cache_hit_rate": server.get("cache_hit_rate") if server else None,
              "quality_name": quality_name,
              "quality": quality(ok_states, key) if quality and len(ok_states) == n else None}
    if args.backend == "hf":
        result["unconstrained_calls"] = backend.unconstrained_calls
    return {"metrics": result, "server": server, "hit_rate_timeline": poller.samples if poller else [],
            "errors": errors[:5], "sample_output": _sample(states)}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def _sample(states) -> str:
    for st in states:
        if st.error() is None:
            return st.text()[-300:]
    return ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    ap.add_argument("--backend", choices=("lmprog", "oai", "hf"), default="lmprog")
    ap.add_argument("--base-url", default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct", help="model name for the oai backend")
    ap.add_argument("--oai-grammar", choices=("json_schema", "gbnf"), default="json_schema")
    ap.add_argument("--model-path", default="default", help="hf backend: model folder or GGUF")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-threads", type=int, default=None, help="hf backend: torch threads")
    ap.add_argument("--num-programs", type=int, default=None, help=f"defaults: {DEFAULT_SIZES}")
    ap.add_argument("--parallel", type=int, default=16, help="run_batch threads (programs in flight)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--request-timeout", type=float, default=1800.0)
    ap.add_argument("--system", default=None)
    ap.add_argument("--output-file", default=None)
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    args.base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")

    out = run_workload(args)
    m = out["metrics"]
    system = args.system or args.backend
    hit = "n/a" if m["cache_hit_rate"] is None else f"{m['cache_hit_rate']:.1%}"
    quality = "" if m["quality"] is None else f", {m['quality_name']} {m['quality']:.2f}"
    print(f"{system} / {args.workload}: {m['programs']} programs in {m['wall_s']:.1f}s = "
          f"{m['programs_per_s']:.2f} programs/s, cache hit rate {hit}{quality}, failed {m['failed']}")
    for e in out["errors"][:3]:
        print("  error:", e)
    if args.output_file:
        result = {"kind": "programs", "system": system, "workload": args.workload,
                  "command": "python " + " ".join(sys.argv), "config": vars(args), **out}
        os.makedirs(os.path.dirname(os.path.abspath(args.output_file)), exist_ok=True)
        with open(args.output_file, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.output_file}")
    return 0 if m["failed"] < m["programs"] else 1


if __name__ == "__main__":
    sys.exit(main())
