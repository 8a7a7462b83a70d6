"""Differential fuzzing of the cfg grammar engine against jsonschema.

Each corpus schema (optionally mutated: a keyword added to one of its subschemas) is compiled
by the cfg backend; instances (the corpus's own, the warm-up's samples, and mutants of both:
a number moved, a string changed, a member dropped or added, an item duplicated ...) are
walked token by token through write_mask / accept_token, as a constrained decode would, and
the verdict is compared with jsonschema's under the schema's dialect (format assertion as
the engine applies it). Reported per instance:

- `accepts_invalid`: the grammar takes an instance the validator refuses (an exactness bug);
- `mask_not_matcher`: the mask offers a token accept_token refuses (a decode would fail);
- `bitmask_not_mask`: the int32 bitmask (`write_bitmask`, the scheduler's) differs from the bool
  mask (`write_mask`) at some step: the two paths' memos disagree;
- `crash`: compiling or masking raised something other than GrammarError;
- `rejects_valid`: a valid instance refused (a narrowing, or a bug);
- `dead_end` (with `--sampled N`: N decodes per schema that sample each token from the mask,
  short tokens first, and stop at EOS where the mask allows it or after MAX_SAMPLED tokens):
  an empty mask before the value is complete, where the schema's first mask was not (a
  decode has nothing to sample: docs/constrained.md, "Liveness", names the checks that can
  still get there); a sampled text that completes is judged like an instance, and a sampled
  token accept_token refuses is `mask_not_matcher`;
- `known`: a divergence the docs name (docs/constrained.md, "Liveness"): an integer written
  with an exponent, ECMA-262 `\\w` / `\\d` / `\\s` / `\\b` being ASCII where Python's `re` (the
  validator's) is not, schemas with a custom `$vocabulary` (jsonschema reads none), draft-07
  `dependencies` read in 2020-12 schemas, an email with a second `@` or a space (jsonschema's
  check only asks for an `@`), more whitespace in a row than the default pattern's 16, jsonschema's bool / number equality inside arrays (`[0] ==
  [false]` for its uniqueItems), and its float arithmetic (decided twice, with floats and
  with Decimals: where the two validators disagree the instance is skipped).

    python bench/fuzz_grammar.py --corpus suite --seed 1 --schema-mutations 2
    python bench/fuzz_grammar.py --corpus suite --seed 1 --sampled 4
Writes a JSON report (--out) and exits 1 when any instance is in the first three classes.
"""
from __future__ import annotations

import argparse
import copy
import decimal
import json
import pathlib
import random
import re
import sys
import time
from collections import Counter

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_grammar as bg  # noqa: E402

SERIOUS = ("accepts_invalid", "mask_not_matcher", "bitmask_not_mask", "crash")
MAX_SAMPLED = 300  # tokens of one sampled decode (--sampled) at most
# keywords a schema mutation adds to one subschema (one each time)
ADDITIONS = (
    {"minimum": 2}, {"maximum": 5}, {"exclusiveMaximum": 3}, {"exclusiveMinimum": -1}, {"multipleOf": 0.5},
    {"multipleOf": 3}, {"minLength": 2}, {"maxLength": 3}, {"pattern": "^[a-c]*$"}, {"pattern": "b"},
    {"uniqueItems": True}, {"minItems": 1}, {"maxItems": 2}, {"minProperties": 1}, {"maxProperties": 1},
    {"additionalProperties": False}, {"not": {"type": "string"}}, {"not": {"const": 1}},
    {"propertyNames": {"maxLength": 3}}, {"contains": {"type": "integer"}},
    {"if": {"type": "string"}, "then": {"minLength": 2}, "else": {"type": ["integer", "object", "array", "null"]}},
    {"oneOf": [{"type": "string"}, {"type": "integer"}]}, {"anyOf": [{"maxLength": 2}, {"type": "number"}]},
    {"enum": [1, "a", None, [1], {"a": 1}]}, {"const": "abc"}, {"type": "integer"}, {"type": ["string", "null"]},
    {"required": ["zz"]}, {"dependentRequired": {"a": ["b"]}}, {"minContains": 2, "contains": {"type": "integer"}},
    {"allOf": [{"minimum": 0}, {"maximum": 10}]}, {"format": "date"}, {"format": "email"},
    {"patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False},
    {"items": {"enum": [1, 2, "a"]}, "uniqueItems": True}, {"dependentSchemas": {"a": {"required": ["b"]}}},
    {"$ref": "#"}, {"propertyNames": {"enum": ["a", "b", "foo"]}}, {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    {"not": {"required": ["a"]}}, {"maxLength": 0}, {"minimum": 0.5, "multipleOf": 0.25},
    {"prefixItems": [{"type": "integer"}], "items": False}, {"unevaluatedProperties": False},
    {"contains": {"const": 1}, "maxContains": 1}, {"not": {"pattern": "b"}}, {"type": "string", "not": {"pattern": "^a.c"}},
)
_ECMA_CLASSES = re.compile(r"\\[wWdDsSbB]")
_STANDARD = re.compile(r"^https?://json-schema\.org/")


def _paths(v, path=()):
    yield path, v
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, path + (i,))


def _replace(root, path, new):
    if not path:
        return new
    cur = root
    for p in path[:-1]:
        cur = cur[p]
    cur[path[-1]] = new
    return root


def _mutated_value(rng: random.Random, v):
    if isinstance(v, bool):
        return rng.choice([not v, None, 0, "true"])
    if isinstance(v, (int, float)):
        return rng.choice([v + 1, v - 1, v * 2, -v, v + 0.5, 0, 10, 3, -0.5, str(v),
                           float(v) if isinstance(v, int) else (int(v) if abs(v) < 1e300 else 0)])
    if isinstance(v, str):
        return rng.choice([v + "a", "", v * 5, "1", v[:-1], v + "\u00e9", v.upper(), "2020-01-01", "a" * 20, v + " ", 1])
    if v is None:
        return rng.choice([0, False, "", {}, []])
    if isinstance(v, dict):
        v, keys = dict(v), list(v)
        op = rng.randrange(5)
        if op == 0 and keys:
            del v[rng.choice(keys)]
        elif op == 1:
            v[rng.choice(["zz", "foo", "bar", "a", "baz", "b"])] = rng.choice([1, "x", None, [], {}])
        elif op == 2 and keys:
            k = rng.choice(keys)
            v[k + "x"] = v.pop(k)
        elif op == 3 and keys:
            k = rng.choice(keys)
            v[k] = _mutated_value(rng, v[k])
        else:
            return rng.choice([[], "obj", None, {}])
        return v
    if isinstance(v, list):
        v, op = list(v), rng.randrange(5)
        if op == 0 and v:
            del v[rng.randrange(len(v))]
        elif op == 1 and v:
            v.append(copy.deepcopy(rng.choice(v)))
        elif op == 2:
            v.append(rng.choice([1, "x", None, True, [], {}]))
        elif op == 3 and v:
            i = rng.randrange(len(v))
            v[i] = _mutated_value(rng, v[i])
        else:
            return rng.choice([{}, "arr", []])
        return v
    return v


def mutants(rng: random.Random, value, n: int) -> list:
    out = []
    for _ in range(n):
        x = copy.deepcopy(value)
        for _ in range(rng.choice((1, 1, 2))):
            path, sub = rng.choice(list(_paths(x)))
            x = _replace(x, path, _mutated_value(rng, sub))
        out.append(x)
    return out


def mutated_schema(rng: random.Random, schema):
    """`schema` with one keyword of ADDITIONS added to one of its subschema objects."""
    s = copy.deepcopy(schema)
    data = ("enum", "const", "default", "examples", "required")
    maps = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
    subs = [(p, v) for p, v in _paths(s) if isinstance(v, dict)
            and not any(k in data for k in p if isinstance(k, str)) and not (p and p[-1] in maps)]
    _, sub = rng.choice(subs)
    sub.update(copy.deepcopy(rng.choice(ADDITIONS)))
    return s


class Reference:
    """jsonschema's verdict under the schema's dialect, decided with floats and with Decimals
    (None where the two disagree: jsonschema's float arithmetic)."""

    def __init__(self, schema, registry, remotes):
        import jsonschema

        from lmprog_runtime.constrained.cfg.dialect import inferred_dialect
        from lmprog_runtime.constrained.cfg.formats import format_asserted
        from lmprog_runtime.constrained.cfg.registry import SchemaRegistry

        eff = inferred_dialect(schema)
        asserted = format_asserted(eff, SchemaRegistry(remotes))
        cls = jsonschema.validators.validator_for(eff, default=jsonschema.Draft202012Validator)
        self.float = cls(eff, registry=registry, format_checker=cls.FORMAT_CHECKER if asserted else None)
        whole = cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator)

        def integer(_checker, v):
            if isinstance(v, bool):
                return False
            if isinstance(v, int):
                return True
            return not whole and isinstance(v, decimal.Decimal) and v == v.to_integral_value()
        dcls = jsonschema.validators.extend(cls, type_checker=cls.TYPE_CHECKER.redefine("integer", integer))
        self.exact = dcls(_decimals(eff), registry=registry, format_checker=cls.FORMAT_CHECKER if asserted else None)

    def valid(self, text: str):
        a = self.float.is_valid(json.loads(text))
        b = self.exact.is_valid(json.loads(text, parse_float=decimal.Decimal))
        return a if a == b else None


def _decimals(schema):
    return json.loads(json.dumps(schema), parse_float=decimal.Decimal)


def _registry(remotes):
    import referencing
    from referencing.jsonschema import DRAFT202012
    resources = []
    for base, folder in remotes:
        for p in pathlib.Path(folder).rglob("*.json"):
            try:
                contents = json.loads(p.read_text())
            except ValueError:
                continue
            resources.append((base + str(p.relative_to(folder)),
                              referencing.Resource.from_contents(contents, default_specification=DRAFT202012)))
    return referencing.Registry().with_resources(resources)


def spelled(rng: random.Random, value) -> str:
    """`value` as compact JSON with some string characters written as escapes (`\\u0061`,
    `\\/`): the same value, other bytes (keys, enums, patterns and formats read the decoded
    text), or pretty-printed now and then."""
    if rng.random() < 0.2:
        return json.dumps(value, ensure_ascii=rng.random() < 0.5, indent=2)

    def text(s: str) -> str:
        out = []
        for ch in s:
            plain = json.dumps(ch, ensure_ascii=False)[1:-1]
            r = rng.random()
            if r < 0.15:
                out.append("\\u%04x" % ord(ch) if ord(ch) < 0x10000 else plain)
            elif r < 0.2 and ch == "/":
                out.append("\\/")
            else:
                out.append(plain)
        return '"' + "".join(out) + '"'

    def dump(v) -> str:
        if isinstance(v, str):
            return text(v)
        if isinstance(v, dict):
            return "{" + ",".join(text(k) + ":" + dump(x) for k, x in v.items()) + "}"
        if isinstance(v, list):
            return "[" + ",".join(dump(x) for x in v) + "]"
        return json.dumps(v)
    return dump(value)


def walk(grammar, tok, text: str):
    """True / False: the grammar takes / refuses `text` (then EOS); "mask_not_matcher" where the
    mask offers a token accept_token refuses; "bitmask_not_mask" where the int32 bitmask the
    scheduler reads (written first, as a decode step would) is not the bool mask packed."""
    from lmprog_runtime.constrained.base import GrammarError
    g = grammar.copy()
    row = np.zeros(len(tok), dtype=np.bool_)
    words = np.zeros(-(-len(tok) // 32), dtype=np.int32)
    for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]:
        g.write_bitmask(words)
        g.write_mask(row)
        if not np.array_equal(np.unpackbits(words.view(np.uint8), bitorder="little")[:len(tok)].view(np.bool_), row):
            return "bitmask_not_mask"
        try:
            g.accept_token(t)
        except GrammarError:
            return "mask_not_matcher" if row[t] else False
        if not row[t]:
            return False  # (the mask looks a byte further than accept_token)
    return True


def sampled(grammar, tok, rng: random.Random, short: np.ndarray):
    """One decode that samples each token from the mask (a token of at most two characters
    four times in five, where one is allowed; EOS, where allowed, three times in ten):
    ("done", text) at EOS, ("dead_end", text) at an empty mask, ("mask_not_matcher", text)
    where accept_token refuses the sampled token, ("cap", text) after MAX_SAMPLED tokens."""
    from lmprog_runtime.constrained.base import GrammarError
    g = grammar.copy()
    row = np.zeros(len(tok), dtype=np.bool_)
    eos = tok.eos_token_id
    out: list = []
    for _ in range(MAX_SAMPLED):
        g.write_mask(row)
        allowed = np.flatnonzero(row)
        if not len(allowed):
            return "dead_end", tok.decode(out)
        if row[eos] and rng.random() < 0.3:
            return "done", tok.decode(out)
        few = allowed[short[allowed]]
        pick = int(rng.choice(few if len(few) and rng.random() < 0.8 else allowed))
        if pick == eos:
            return "done", tok.decode(out)
        try:
            g.accept_token(pick)
        except GrammarError:
            return "mask_not_matcher", tok.decode(out + [pick])
        out.append(pick)
    return "cap", tok.decode(out)


def known(schema, text: str, got: bool) -> bool:
    """A documented divergence (module docstring)."""
    src = json.dumps(schema)
    dialect = schema.get("$schema") if isinstance(schema, dict) else None
    if isinstance(dialect, str) and not _STANDARD.match(dialect):
        return True  # (a custom metaschema's $vocabulary: jsonschema reads none)
    if not got and re.search(r"\d[eE][+-]?\d", text):
        return True  # (integers: no exponent)
    if _ECMA_CLASSES.search(src) and any(ord(c) > 127 for c in text):
        return True  # (ECMA-262 classes are ASCII)
    if not got and '"dependencies"' in src:
        return True  # (draft-07 dependencies read in 2019-09 / 2020-12 schemas too)
    if not got and '"email"' in src:
        return True  # (an email with a second `@`, a space: jsonschema's check only asks for an `@`)
    if not got and re.search(r"\s{17}", text):
        return True  # (more whitespace in a row than the default whitespace pattern's 16)
    if not got and '"uniqueItems"' in src and re.search(r"\b(true|false)\b", text):
        return True  # (jsonschema's bool / number equality inside arrays: [0] == [false] there)
    return False


def _sampled_findings(grammar, tok, rng, short, n: int, ref, name: str, schema, counts: Counter,
                      findings: list) -> None:
    """`n` sampled decodes of one schema (`sampled`), their findings recorded."""
    row = np.zeros(len(tok), dtype=np.bool_)
    grammar.copy().write_mask(row)
    if not row.any():
        counts["unsatisfiable_schemas"] += 1  # (no value at all: nothing to sample)
        return
    for _ in range(n):
        try:
            end, text = sampled(grammar, tok, rng, short)
        except Exception as exc:  # noqa: BLE001
            counts["crash"] += 1
            findings.append({"class": "crash", "case": name, "schema": schema, "error": repr(exc)})
            continue
        counts["sampled"] += 1
        if end == "done":
            try:
                expect = ref.valid(text)
            except Exception:  # noqa: BLE001 - jsonschema raised on this text
                expect = None
            if expect is None:
                counts["unjudged"] += 1
                continue
            if expect or known(schema, text, True):
                continue
            end = "accepts_invalid"
        elif end == "cap":
            counts["sampled_cap"] += 1
            continue
        counts[end] += 1
        findings.append({"class": end, "case": name, "schema": schema, "text": text, "sampled": True})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default="suite", choices=sorted(bg.CORPORA))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--schema-mutations", type=int, default=0, help="mutated schemas per corpus schema (0: as is)")
    ap.add_argument("--instance-mutations", type=int, default=3, help="mutants per instance")
    ap.add_argument("--limit", type=int, default=0, help="first N schemas only")
    ap.add_argument("--spellings", action="store_true",
                    help="write instances with escapes in their strings (or pretty-printed), not compact")
    ap.add_argument("--sampled", type=int, default=0, help="decodes per schema sampling tokens from the mask")
    ap.add_argument("--trace", action="store_true", help="print each schema before it is compiled (stderr)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "fuzz_grammar.json"))
    args = ap.parse_args()

    from tqdm import tqdm

    from lmprog_runtime.constrained import create_grammar_backend
    from lmprog_runtime.constrained.base import GrammarBackendConfig, GrammarError
    from lmprog_runtime.constrained.cfg import warmup
    from lmprog_runtime.constrained.cfg.refs import RefIndex

    rng = random.Random(args.seed)
    tok = bg.load_tokenizer()
    cases = bg.load_cases(args.corpus)[:args.limit or None]
    remotes = bg.SUITE_REMOTES if args.corpus == "suite" else ()
    registry = _registry(remotes)
    be = create_grammar_backend("cfg", tok, len(tok), [tok.eos_token_id],
                                config=GrammarBackendConfig(schema_remotes=remotes))
    counts, findings, t0 = Counter(), [], time.time()
    short = np.array([0 < len(tok.decode([t])) <= 2 for t in range(len(tok))], dtype=np.bool_)
    for case in tqdm(cases, desc=f"fuzz {args.corpus}", unit="schema"):
        schemas = [case["schema"]] if not args.schema_mutations or not isinstance(case["schema"], dict) else \
            [mutated_schema(rng, case["schema"]) for _ in range(args.schema_mutations)]
        for schema in schemas:
            if args.trace:  # (the schema a crash of the whole process was at: the last one printed)
                print("\nschema", case["name"], json.dumps(schema), file=sys.stderr, flush=True)
            try:
                grammar = be.get_future("json", json.dumps(schema)).result(timeout=60)
            except GrammarError as exc:
                if args.trace:
                    print("refused:", str(exc)[:200], file=sys.stderr, flush=True)
                counts["refused_schemas"] += 1
                continue
            except Exception as exc:  # noqa: BLE001 - a crash is a finding, not the fuzzer's end
                counts["crash"] += 1
                findings.append({"class": "crash", "case": case["name"], "schema": schema, "error": repr(exc)})
                continue
            try:
                ref = Reference(schema, registry, remotes)
            except Exception:  # noqa: BLE001 - jsonschema cannot judge this schema
                counts["unjudged_schemas"] += 1
                continue
            if args.sampled:
                _sampled_findings(grammar, tok, rng, short, args.sampled, ref, case["name"], schema, counts, findings)
            values = [t["data"] for t in case["tests"]]
            try:
                root = RefIndex(schema, None)
                values += [v for v in (warmup.sample(schema, root, alt=a) for a in (0, 1)) if v is not warmup._NONE]
            except Exception:  # noqa: BLE001 - samples are a bonus
                pass
            values += [m for v in list(values) for m in mutants(rng, v, args.instance_mutations)]
            seen = set()
            for value in values:
                try:
                    text = spelled(rng, value) if args.spellings else json.dumps(value, ensure_ascii=False,
                                                                               separators=(",", ":"))
                except (TypeError, ValueError):
                    continue
                if text in seen:
                    continue
                seen.add(text)
                try:
                    expect = ref.valid(text)
                except Exception:  # noqa: BLE001 - jsonschema raised on this instance
                    counts["unjudged"] += 1
                    continue
                if expect is None:
                    counts["unjudged"] += 1
                    continue
                try:
                    got = walk(grammar, tok, text)
                except Exception as exc:  # noqa: BLE001
                    counts["crash"] += 1
                    findings.append({"class": "crash", "case": case["name"], "schema": schema, "text": text,
                                     "error": repr(exc)})
                    continue
                counts["instances"] += 1
                if got in ("mask_not_matcher", "bitmask_not_mask"):
                    kind = got
                elif got == expect:
                    continue
                elif known(schema, text, got):
                    kind = "known"
                else:
                    kind = "accepts_invalid" if got else "rejects_valid"
                counts[kind] += 1
                findings.append({"class": kind, "case": case["name"], "schema": schema, "text": text})
    be.shutdown()
    report = {"corpus": args.corpus, "seed": args.seed, "schema_mutations": args.schema_mutations,
              "instance_mutations": args.instance_mutations, "seconds": round(time.time() - t0, 1),
              "counts": dict(counts), "findings": findings}
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(report, indent=1, ensure_ascii=False))
    print(json.dumps(report["counts"]))
    for f in findings:
        if f["class"] in SERIOUS or f["class"] in ("rejects_valid", "dead_end"):
            print(f["class"], f["case"], json.dumps(f["schema"])[:200], f.get("text", f.get("error", ""))[:160])
    return 1 if any(counts[c] for c in SERIOUS) else 0


if __name__ == "__main__":
    sys.exit(main())
