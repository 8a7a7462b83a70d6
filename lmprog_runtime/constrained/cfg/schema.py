"""JSON Schema -> value grammar (nodes.py).

`SchemaCompiler(root).compile()` walks the schema once, making one `Node` per distinct
subschema (memoized by identity, so `$ref` cycles become cycles of nodes), with string
patterns and formats as lazy regex states (regex.py). Nothing is expanded: `maxLength`,
`maxItems` and enum sizes are counters and tries, objects take keys in any order with the
required set checked at `}`, a missing `additionalProperties` allows extra keys (the spec),
and free-form values are one self-referencing node (no depth bound).
"""
from __future__ import annotations

import time
from decimal import ROUND_CEILING, Decimal, InvalidOperation, localcontext
from typing import Optional

from jsonschema.validators import Draft3Validator, Draft4Validator, Draft202012Validator, validator_for

from lmprog_runtime.constrained.cfg.formats import FORMATS, HOSTNAME_CHARS, dialect_formats, format_asserted
from lmprog_runtime.constrained.cfg.nodes import _EXACT, ALL_TYPES, Node
from lmprog_runtime.constrained.cfg.regex import NEVER, RegexError, RegexPool
from lmprog_runtime.constrained.cfg.refs import RefIndex
from lmprog_runtime.constrained.cfg.regex_parse import compile_pattern
from lmprog_runtime.constrained.cfg.residual import Residual
from lmprog_runtime.constrained.cfg.registry import SchemaRegistry
from lmprog_runtime.constrained.json_schema import _json_type
from lmprog_runtime.constrained.regex_fragments import UnsupportedSchemaError
from lmprog_runtime.constrained.schema_merge import ANNOTATIONS, intersect_types, merge_all

# keywords the structure expresses exactly; any other keyword makes the node residual
EXACT = {"type", "enum", "const", "properties", "required", "additionalProperties", "patternProperties",
         "propertyNames", "minProperties", "maxProperties", "dependentRequired", "items", "prefixItems",
         "additionalItems", "minItems", "maxItems", "uniqueItems", "minLength", "maxLength", "pattern",
         "format", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "anyOf",
         "$ref", "allOf"} | ANNOTATIONS | {"$anchor", "$dynamicAnchor", "$vocabulary", "nullable"}
MAX_NODES = 200_000
NOT_REQUIRED_NAMES = 4  # `not {required: names}` made structure up to this many names (_not_decided_early)
ENUM_CHARS_CHECKED = 1 << 16  # a string enum up to this many characters is narrowed to the members its rule takes
ENUM_MEMBERS_CHECKED = 256    # an enum / const beside other keywords: up to this many members validated at compile
REFS_SCANNED = 10_000         # ... in a schema whose reference keywords are looked for in this many nodes at most


class SchemaCompiler:
    def __init__(self, root, pool: Optional[RegexPool] = None, deadline: Optional[float] = None,
                 registry: Optional[SchemaRegistry] = None, unevaluated_structure: bool = True,
                 ids_move_base: bool = True):
        """unevaluated_structure: unevaluatedProperties / unevaluatedItems beside in-place
        applicators made structure or a bound on it (`_merge_evaluated`, `_unevaluated_bound`);
        False: checks on the complete value alone (`unevaluated_tried` says whether a compile
        took that path: backend.py compiles again without it where the structure refused).
        ids_move_base: a draft-04 / draft-03 document's `id`s set base URIs (refs.RefIndex;
        `refs.legacy_ids` says whether one did: backend.py compiles again reading them as
        labels where a reference then does not resolve)."""
        self.root = root
        self.unevaluated_structure, self.unevaluated_tried = unevaluated_structure, False
        self.pool = pool or RegexPool()
        self.deadline = deadline
        self._memo: dict[int, Node] = {}
        self._keep: list = []  # schemas built here (merges) stay alive: the memo keys are ids
        self._written: Optional[set] = None  # ids of the root document's schema objects (`_as_written`)
        self.refs = RefIndex(root, registry, ids_move_base)
        self._registry = registry
        self._checker: Optional[Residual] = None  # validates enum members at compile (`_valid_members`; the machine's after)
        self.assert_format = format_asserted(root, self.refs.registry)
        self.formats = dialect_formats(root)  # (those an older draft defines: the others are annotations)
        # keywords the residual's validator asserts (residual.py picks the same class): any
        # other keyword is an annotation (`x-...`, `_format`), for which no check is kept
        cls = validator_for(root, default=Draft202012Validator) if isinstance(root, dict) else Draft202012Validator
        self._asserting = frozenset(cls.VALIDATORS)
        # draft-04 and older: exclusiveMinimum / exclusiveMaximum are flags on minimum / maximum
        # (a number there bounds nothing: a non-zero one sets the flag, as the validator reads it)
        self._boolean_exclusive = cls in (Draft3Validator, Draft4Validator)
        self._origin: dict[int, object] = {}  # id(made schema) -> the schema it stands for
        self._derefs: dict[int, dict] = {}  # id(schema with a $ref and siblings) -> the allOf deref made of it
        self.any = self._any_node()
        self.n_nodes = 0
        self._scalars: dict = {}  # _scalar_signature -> the first node compiled with it
        self._complements: dict = {}  # id(schema made by _not_pattern) -> the complement pattern its strings take
        self._filling: set = set()  # ids of the nodes whose _fill is running (_take)

    def compile(self) -> Node:
        root = self.node(self.root)
        if not self.refs.dynamic:
            return root
        # dynamic references: every rule is a superset, the whole value is checked at its end
        for n in _reachable_nodes(root):
            n.residual = None
        top = Node(self.root)
        self._copy(top, root)
        top.residual, top.name = self.root, "dynamic-root"
        return top

    # ------------------------------------------------------------ refs
    def resolve(self, ref: str, at):
        return self.refs.resolve(ref, at)

    def deref(self, s, depth: int = 0):
        """`s` with a bare top-level `$ref` followed (siblings become an allOf)."""
        while isinstance(s, dict) and isinstance(s.get("$ref"), str) and depth < 64:
            target = self.resolve(s["$ref"], s)
            rest = {k: v for k, v in s.items() if k != "$ref" and k not in ANNOTATIONS}
            if rest:  # (the siblings beside the allOf: the schema's own keywords, as _fill reads them)
                made = self._derefs.get(id(s))
                if made is None:  # (one per schema: met again, through a reference back to it, it is one node)
                    made = self._made({"allOf": [target], **rest} if "allOf" not in rest else {"allOf": [target, rest]}, s)
                    self._origin[id(made)] = self._origin.get(id(s), s)  # checks run on the schema as written
                    self._derefs[id(s)] = made
                s = made
            else:
                s = target
            depth += 1
        return s

    def _made(self, s, like=None):
        self._keep.append(s)
        if like is not None:
            self.refs.adopt(s, like)
        return s

    # ------------------------------------------------------------ nodes
    def node(self, s) -> Node:
        if isinstance(s, dict) and ("$dynamicRef" in s or "$recursiveRef" in s):
            self.refs.dynamic = True  # its target is checked by the whole-value residual (compile)
            # (and the unevaluated* beside it, which it evaluates for: read alone they would be
            # narrower than the schema, while a superset is all the structure must be)
            s = self._made({k: v for k, v in s.items() if k not in _DYNAMIC_DROPPED}, s)
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise UnsupportedSchemaError("compile budget exhausted")
        s = self.deref(s)
        key = id(s)
        got = self._memo.get(key)
        if got is not None:
            return got
        self.n_nodes += 1
        if self.n_nodes > MAX_NODES:
            raise UnsupportedSchemaError(f"schema has more than {MAX_NODES} rules")
        if _takes_every_value(s):
            self._memo[key] = self.any
            return self.any
        n = Node(s)
        self._memo[key] = n  # before filling: recursive references find it
        if s is False:
            n.never = True
            return n
        if not isinstance(s, dict):
            raise UnsupportedSchemaError(f"a schema must be an object or a boolean, got {type(s).__name__}")
        self._filling.add(id(n))
        try:
            self._fill(n, s)
        finally:
            self._filling.discard(id(n))
        if n.residual is not None:
            n.residual = self._origin.get(id(n.residual), n.residual)
        if self.refs.dynamic:
            n.residual = None  # the whole value is checked instead (compile)
        if n.alts is None and n.residual is None and not n.never and not n.types & _CONTAINERS:
            # a scalar rule: one node for every subschema that compiles to the same rule (the
            # properties of one type share their states, table rows and masks)
            same = self._scalars.setdefault(_scalar_signature(n), n)
            if same is not n:
                self._memo[key] = same
                return same
        return n

    def _fill(self, n: Node, s: dict) -> None:
        if ("enum" in s or "const" in s) and set(s) - _ENUM_ALONE:
            s = self._valid_members(s)
            if s is False:  # (no member meets the keywords beside them: no value)
                n.never = True
                return
        if "if" in s and (s.get("else") is False or s.get("then") is False or s["if"] is False
                          or self._takes_any(s["if"])):
            s = self._conditional_as_all_of(s)
        sub = s.get("not", False)
        if _takes_every_value(sub):
            n.never = True  # (`not {}`: no value, as `false`; a check at the value's end was a dead end)
            return
        t = _kinds_narrowed(s)
        if t is False:  # (its `not` / allOf / anyOf / oneOf leave no kind of value)
            n.never = True
            return
        if t is not s:
            self._origin[id(t)] = self._origin.get(id(s), s)  # (checks run on the schema as written)
            s = self._made(t, s)
        if isinstance(s.get("oneOf"), list):
            t = _one_of_kinds(s, [self.deref(alt) for alt in s["oneOf"]])
            if t is False:  # (two branches take every value of each kind the rest allows: none)
                n.never = True
                return
            if t is not s:
                s = self._made(t, s)
        if "not" in s:
            t = _not_decided_early(s, bounds=not self._boolean_exclusive)
            if t is s:
                t = self._not_pattern(s)
            if t is False:  # (the `not` refuses every kind the rest allows: no value)
                n.never = True
                return
            if t is not s:
                s = self._made(t, s)
        if "allOf" in s:
            parts = [self.deref(x) for x in s["allOf"]] + [{k: v for k, v in s.items() if k != "allOf"}]
            merged = None
            # (a part's unevaluated* sees only that part: where nothing in it applies in place,
            # it is that part's additionalProperties / items; not the schema's own keywords')
            local = [_unevaluated_locally(p) if isinstance(p, dict) else p for p in parts[:-1]] + parts[-1:]
            if _UNEVALUATED & set(parts[-1]):
                merged = self._merge_evaluated(parts, s) if self.unevaluated_structure else None
            elif _mergeable(local):
                try:
                    merged = self._made(merge_all(local), s)
                except UnsupportedSchemaError:
                    merged = None
            if merged is not None and not _has_ref_cycle(merged, s):
                self._take(n, self.node(merged))
                if n.residual is not None:
                    n.residual = s  # the conjunction as written: merging may move keywords' scope
                return
            n.residual = s  # structure from the parts merged past their scopes, the whole conjunction checked at the end
            first = self._superset(local, parts[0])
            if first is parts[0]:
                first = _with_types(parts[0], s)  # (held to the conjunction's types: a value of another is never valid)
                if first is not parts[0] and isinstance(first, dict):
                    self._origin[id(first)] = self._origin.get(id(parts[0]), parts[0])
                    first = self._made(first, parts[0])
            self._take(n, self.node(first))
            n.residual = s
            return
        for combo in ("anyOf", "oneOf"):
            if combo in s:
                self._choice(n, s, combo)
                return
        choice = _enum_as_choice(s)
        if choice is not None:  # objects / arrays in an enum: their structure, checked whole at the end
            self._choice(n, self._made(choice, s), "anyOf")
            _keep_check(n, s, _enum_kinds([s["const"]] if "const" in s else s["enum"]))
            return
        local = _unevaluated_locally(s)
        bound = self._unevaluated_bound(s) if local is s and "unevaluatedProperties" in s else None
        if bound is not None:  # (the structure bounded by the members any part may evaluate; checked as written)
            local = _bounded({k: v for k, v in s.items() if k != "unevaluatedProperties"}, bound)
        if local is not s:
            self._made(local, s)
        self._typed(n, local)
        checked = ((set(local) - EXACT) | (set(s) & _UNEVALUATED if bound is not None else set())) & self._asserting
        if checked:  # (checked as written)
            _keep_check(n, s, _checked_kinds(checked, local))

    def _valid_members(self, s: dict):
        """`s` with its enum (or const) narrowed to the members that are valid under the
        whole of `s` (validated at compile, as the residual validates a complete value), False
        where none is. The structure of an enum's members and the keywords beside it were
        followed apart, each a superset, so a member the keywords refuse was begun and then
        refused at its end (`{"const": {"a": false}, "patternProperties": {"^a": {"type":
        "integer"}}}` took `{"a":false` and nothing after it). Only where no dynamic
        reference is in the document, `s` holds neither a reference nor an unevaluated*
        keyword unless it is a subschema of the document as written (a merge may hold them
        other than as written; a subschema as written is validated as the residual would:
        its references resolved from the `$id`s around it, what its unevaluated* read
        inside it), and at most ENUM_MEMBERS_CHECKED members. A member whose check cannot
        be carried out (an unresolvable reference) goes, as the residual check at the
        value's end would refuse it."""
        values = [s["const"]] if "const" in s else s["enum"]
        if (not isinstance(values, list) or not values or len(values) > ENUM_MEMBERS_CHECKED or self.refs.dynamic
                or ((_UNEVALUATED & set(s) or _refers(s)) and not self._as_written(s))):
            return s
        checker = self.checker()
        try:
            kept = [v for v in values if checker.valid(v, s)]
        except Exception:  # noqa: BLE001 - (Residual.valid answers False itself; anything else keeps them)
            return s
        if len(kept) == len(values):
            return s
        if not kept:
            return False
        out = {k: v for k, v in s.items() if k not in ("enum", "const")}
        out["enum"] = kept
        return self._made(out, s)

    def checker(self) -> Residual:
        """The residual checks' validator of this document (made once: it crawls the registry)."""
        if self._checker is None:
            self._checker = Residual(self.root, self._registry, self.refs.docs)
        return self._checker

    def _as_written(self, s) -> bool:
        """`s` is a schema object of the root document as written (not one made here)."""
        if self._written is None:
            self._written, stack = set(), [self.root]
            while stack and len(self._written) < MAX_NODES:
                x = stack.pop()
                if isinstance(x, dict):
                    if id(x) not in self._written:
                        self._written.add(id(x))
                        stack.extend(x.values())
                elif isinstance(x, list):
                    stack.extend(x)
        return id(s) in self._written

    def _conditional_as_all_of(self, s: dict) -> dict:
        """`s` with an if / then / else one of whose branches is `false`, or whose `if` is
        `true` / `{}` / `false`, as the allOf it means: with `else: false` a value meets `if`
        (and `then`), with `then: false` it does not (and meets `else`); an `if` every value
        meets is its `then`, one none meets its `else`. What `if` evaluates is evaluated all
        the same (an annotation of a passing subschema; `true` and `{}` evaluate nothing). A
        check at the value's end, as before, began values the branch refused and then
        nothing could complete them (`{"if": {"const": 1}, "else": false}` took `{`), and
        was read at every string's closing quote. Checks still run on `s` as written."""
        cond = s["if"]
        if cond is False or self._takes_any(cond):
            parts = [s.get("else", True) if cond is False else s.get("then", True)]
        elif s.get("else") is False:
            parts = [cond, s.get("then", True)]
        else:
            parts = [{"not": cond}, s.get("else", True)]
        out = {k: v for k, v in s.items() if k not in ("if", "then", "else")}
        out["allOf"] = (list(out["allOf"]) if isinstance(out.get("allOf"), list) else []) + parts
        made = self._made(out, s)
        self._origin[id(made)] = self._origin.get(id(s), s)
        return made

    def _merge_evaluated(self, parts: list, s: dict):
        """The conjunction of `parts` (an allOf's, the last the schema's own keywords) whose
        own keywords include unevaluatedProperties / unevaluatedItems, as one schema where
        what the other parts evaluate is known without the instance: every part applies
        unconditionally (allOf, `$ref`, `not`, whose annotations a valid instance never
        keeps; no anyOf / oneOf / if / dependentSchemas / contains / dynamic reference,
        whose annotations depend on which branches pass). The members no part declares are
        then additionalProperties of the merged schema (the items past every part's
        prefix, its items), and where some part has additionalProperties (items as a
        schema, additionalItems after a tuple) it evaluates every member, the keyword none.
        None where neither holds or the parts do not merge (a part with unevaluated* of its
        own among them): the conjunction is then checked on the complete value."""
        self.unevaluated_tried = True
        leaves = self._in_place_leaves(parts[:-1], 0)
        if leaves is None:
            return None
        own = parts[-1]
        flat = leaves + [{k: v for k, v in own.items() if k not in _UNEVALUATED}]
        dicts = [p for p in flat if isinstance(p, dict)]
        words = set().union(*dicts) if dicts else set()
        if _CONDITIONAL & words or any(isinstance(v, (dict, bool)) for p in dicts
                                         for v in (p.get("dependencies") or {}).values()):
            return None
        extra = {}
        if "unevaluatedProperties" in own and "additionalProperties" not in words:
            extra["additionalProperties"] = own["unevaluatedProperties"]
        if "unevaluatedItems" in own:
            if "contains" in words:  # (it evaluates the items it matches)
                return None
            tuples = [p for p in dicts if isinstance(p.get("items"), list)]
            every = any("additionalItems" in p for p in tuples) or any(
                "items" in p and not isinstance(p["items"], list) for p in dicts)
            if not every:
                extra["additionalItems" if tuples else "items"] = own["unevaluatedItems"]
        if not _mergeable(flat):
            return None
        try:
            merged = merge_all(flat)
        except UnsupportedSchemaError:
            return None
        if merged is False or not extra:
            return self._made(merged, s)
        return self._made({**(merged if isinstance(merged, dict) else {}), **extra}, s)

    def _unevaluated_bound(self, s: dict) -> Optional[tuple]:
        """For a schema with unevaluatedProperties beside applicators whose annotations depend
        on the instance (anyOf / oneOf / if / then / else / dependentSchemas): (the names and
        patterns some subschema applied in place may declare, the keyword's schema) — a
        member matched by none is unevaluated whatever passes, so it must satisfy that
        schema: the structure may say so (a superset still; the schema is checked as written
        on the complete value). None where a part may evaluate any member
        (additionalProperties, unevaluatedProperties, a dynamic reference) or there is no
        such keyword."""
        if not isinstance(s, dict) or "unevaluatedProperties" not in s or not self.unevaluated_structure:
            return None
        self.unevaluated_tried = True
        names: set = set()
        patterns: set = set()
        if not self._declared({k: v for k, v in s.items() if k != "unevaluatedProperties"}, names, patterns,
                              set(), 0):
            return None
        for pattern in patterns:  # (a pattern only a check reads, which the structure cannot take: no bound)
            try:
                self._regex(pattern, True)
            except UnsupportedSchemaError:
                return None
        return frozenset(names), frozenset(patterns), s["unevaluatedProperties"]

    def _declared(self, s, names: set, patterns: set, seen: set, depth: int) -> bool:
        """Add to `names` / `patterns` the properties and patternProperties `s` and every
        subschema it applies in place declare; False where one may evaluate any member."""
        if not isinstance(s, dict) or id(s) in seen:
            return True  # (a boolean evaluates nothing; a cycle adds nothing new)
        if depth > 32 or {"additionalProperties", "unevaluatedProperties", "$dynamicRef", "$recursiveRef"} & set(s):
            return False
        seen.add(id(s))
        if isinstance(s.get("properties"), dict):
            names.update(s["properties"])
        if isinstance(s.get("patternProperties"), dict):
            patterns.update(s["patternProperties"])
        subs = [s.get(k) for k in ("if", "then", "else")]
        for k in ("allOf", "anyOf", "oneOf"):
            subs += s.get(k) if isinstance(s.get(k), list) else []
        if isinstance(s.get("dependentSchemas"), dict):
            subs += list(s["dependentSchemas"].values())
        if isinstance(s.get("$ref"), str):
            try:
                subs.append(self.resolve(s["$ref"], s))
            except (UnsupportedSchemaError, ValueError, KeyError):  # (inside a check: its validation decides)
                return False
        return all(self._declared(x, names, patterns, seen, depth + 1) for x in subs if x is not None)

    def _in_place_leaves(self, parts: list, depth: int) -> Optional[list]:
        """`parts` with their allOfs and `$ref`s flattened into the schemas that apply in
        place; None for a reference cycle or nesting past 16."""
        out = []
        for p in parts:
            p = self.deref(p)
            if isinstance(p, dict) and "$ref" in p:
                return None  # (deref gave up: a cycle of references)
            if isinstance(p, dict) and "allOf" in p:
                inner = self._in_place_leaves(p["allOf"], depth + 1) if depth < 16 else None
                if inner is None:
                    return None
                out += inner
                p = {k: v for k, v in p.items() if k != "allOf"}
            out.append(p)
        return out

    def _take(self, n: Node, src: Node) -> None:
        """n gets src's structure: a copy of it, or where src is still being filled (a
        reference back to an enclosing schema: `{"$ref": "#", ...}` inside the root) src
        itself as n's one alternative, so n reads it as it will be, not as it is now."""
        if id(src) in self._filling:
            n.alts = (src,)
        else:
            self._copy(n, src)

    def _copy(self, n: Node, src: Node) -> None:
        for slot in Node.__slots__:
            if slot not in ("schema", "_child", "residual", "checked_kinds"):  # (a check of its own: every kind)
                setattr(n, slot, getattr(src, slot))
        n.residual = n.residual or src.residual
        if src is self.any:
            n.name = "any"

    def _choice(self, n: Node, s: dict, combo: str) -> None:
        base = {k: v for k, v in s.items() if k != combo}
        bound = self._unevaluated_bound(s)
        if bound is not None:  # (each branch's structure bounded by the members any part may evaluate)
            base = {k: v for k, v in base.items() if k != "unevaluatedProperties"}
            n.residual = s
        alts = []
        for alt in s[combo]:
            if _types_disjoint(base, self.deref(alt)):
                continue  # (no value of the types the rest allows meets it)
            try:
                if not _mergeable([base, self.deref(alt)]):
                    raise UnsupportedSchemaError("not mergeable")
                own = self._branch_bound(base, alt, bound) if combo == "oneOf" else bound
                part = self._made(_bounded(merge_all([base, self.deref(alt)]), own), alt)
            except UnsupportedSchemaError:
                part, n.residual = self._superset([base, self.deref(alt)], alt), s
            node = self.node(part)
            if node.residual is not None and part is not alt:
                n.residual = s  # a merged branch's check is decided on the schema as written
            alts.append(node)
        n.alts = tuple(a for a in alts if not a.never)
        if not n.alts or (combo == "oneOf" and sum(map(self._takes_any, s[combo])) > 1):
            n.never = True  # (none; or two branches every value meets: no value meets exactly one)
        if combo == "oneOf" and len(n.alts) > 1 and not _exclusive(n.alts):
            if n.residual is None:  # (exactly one is the only check: needed for the kinds two branches take)
                n.checked_kinds = _shared_kinds(n.alts)
            n.residual = s  # exactly one: decided on the complete value

    def _superset(self, parts: list, fallback):
        """The structure of the conjunction of `parts` that `_mergeable` does not merge, where
        the merge still states it: members and additionalProperties in several parts with no
        patternProperties among them (a member one part declares is held to the others'
        additionalProperties: schema_merge._restrict_extra), else `fallback` (one of the
        parts). The whole conjunction stays a check on the complete value. (`{"properties":
        {"foo": true}, "additionalProperties": false}` beside an anyOf branch declaring `bar`
        took `bar` while the branch alone was the structure, and then the object was refused
        at its end.) Not where the merge would be narrower than the conjunction (keywords
        that act only beside each other split between parts: a lone `else`) or wider than a
        part alone (unevaluated* seeing the others' members, `items` past another part's
        `prefixItems`, a part's members no longer held to another's additionalProperties
        where patterns match them)."""
        dicts = [p for p in parts if isinstance(p, dict)]
        if (any(sum(1 for p in dicts if any(k in p for k in group)) > 1 for group in _ADJACENT)
                or any(_UNEVALUATED & set(p) for p in dicts)
                or sum(1 for p in dicts if any(k in p for k in _ARRAY_SCOPED)) > 1
                or any("patternProperties" in p for p in dicts)
                or any(sum(1 for p in dicts if combo in p) > 1 for combo in ("anyOf", "oneOf"))):
            return fallback  # (nor where two parts' choices would multiply: a structure past what it saves)
        try:
            merged = merge_all(parts)
        except UnsupportedSchemaError:
            return fallback
        if not isinstance(merged, dict) or _has_ref_cycle(merged, fallback):
            return fallback
        return self._made(merged, fallback)

    def _branch_bound(self, base: dict, alt, bound: Optional[tuple]) -> Optional[tuple]:
        """A oneOf branch's own bound on the unevaluated members (`_unevaluated_bound`'s,
        narrowed): where exactly one branch passes, only the rest of the schema and that
        branch evaluate members, so a member neither declares must satisfy the keyword's
        schema (`{"oneOf": [{"properties": {"a": {"const": 1}}, "required": ["a"]}, {"required":
        ["b"]}], "unevaluatedProperties": false}` with `{"a": 2, "b": ...`: `a` is evaluated
        only where its branch passes, so `2` is no value there; it was taken, and the object
        could never end). `bound` where the declarations cannot be told."""
        if bound is None:
            return None
        names: set = set()
        patterns: set = set()
        if not (self._declared(base, names, patterns, set(), 0) and self._declared(alt, names, patterns, set(), 0)):
            return bound
        return frozenset(names), frozenset(patterns), bound[2]

    def _takes_any(self, s) -> bool:
        """Schema `s` (its bare `$ref` followed) is one every value meets."""
        return _takes_every_value(self.deref(s))

    def _any_node(self) -> Node:
        n = Node(True)
        n.name = "any"
        n.additional, n.items = n, n
        n.key_node = Node(True)
        n.key_node.types = frozenset(("string",))
        return n

    # ------------------------------------------------------------ per type
    def _typed(self, n: Node, s: dict) -> None:
        t = s.get("type")
        if t is not None:
            types = {t} if isinstance(t, str) else set(t)
            if not types <= ALL_TYPES:
                raise UnsupportedSchemaError(f"type {sorted(types - ALL_TYPES)} is not a JSON Schema type")
            if s.get("nullable") is True:
                types.add("null")
            n.types = frozenset(types)
        if "enum" in s or "const" in s:
            self._enum(n, s)
        n.literals = frozenset(x for x, ty in (("true", "boolean"), ("false", "boolean"), ("null", "null"))
                               if ty in n.types) & n.literals
        self._string(n, s)
        self._number(n, s)
        self._object(n, s)
        self._array(n, s)
        self._drop_impossible_kinds(n)
        if not n.types:
            n.never = True

    def _enum(self, n: Node, s: dict) -> None:
        values = [s["const"]] if "const" in s else list(s["enum"])
        if "const" in s and "enum" in s:
            values = [v for v in s["enum"] if _same(v, s["const"])]
        kinds = set()
        lits = set()
        for v in values:
            if isinstance(v, bool):
                kinds.add("boolean")
                lits.add("true" if v else "false")
            elif v is None:
                kinds.add("null")
                lits.add("null")
            elif isinstance(v, str):
                kinds.add("string")
            elif isinstance(v, (int, float)):
                kinds |= {"number", "integer"}
            else:
                kinds.add("object" if isinstance(v, dict) else "array")
        n.types = n.types & frozenset(kinds)
        n.literals = frozenset(lits)
        n.enum = tuple(sorted({v for v in values if isinstance(v, str)}))
        nums = {Decimal(repr(v)) if isinstance(v, float) else Decimal(v)
                for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)}
        n.num_enum = tuple(sorted(nums)) if nums else None  # also numbers: a number must equal one
        if kinds - {"boolean", "null", "string"}:  # numbers, objects, arrays in an enum: compared on the complete value
            _keep_check(n, s, _enum_kinds(values))

    def _not_pattern(self, s: dict):
        """`s` with a `not {pattern: P}` rewritten as a string (its type narrowed to strings:
        `{pattern: P}` passes every other kind) in which P's search finds nothing: a pattern
        state of P's complement (RegexPool.complement), dead from the character that
        completes a match of P on (a check at the string's end decides the same, but only
        at its closing quote: every character before it was offered, and a string with a
        match could never close). Keywords of the other kinds beside it read no string: they
        go. False where `s` allows no string; `s` itself where other keywords stand beside it
        (applicators, enums: their `_fill` paths do not reach `_string` with this schema) or
        P does not compile (the check stays)."""
        sub = s["not"]
        if (not isinstance(sub, dict) or set(sub) - ANNOTATIONS != {"pattern"} or not isinstance(sub["pattern"], str)
                or set(s) - ANNOTATIONS - set(_KIND_OF_WORD) - {"type", "not"}):
            return s
        try:
            term = self.pool.complement(compile_pattern(self.pool, sub["pattern"], True))
        except RegexError:
            return s
        out = _narrowed(s, ("string",))
        if out is None or out is False:
            return s if out is None else out
        out = self._made({k: v for k, v in out.items() if _KIND_OF_WORD.get(k, "string") == "string"}, s)
        self._complements[id(out)] = term
        return out

    def _string(self, n: Node, s: dict) -> None:
        n.min_len = int(s.get("minLength", 0))
        n.max_len = int(s["maxLength"]) if "maxLength" in s else None
        pats = []
        if "pattern" in s:
            pats.append(self._regex(s["pattern"], True))
        if id(s) in self._complements:
            pats.append(self._complements[id(s)])
        fmt = s.get("format")
        if isinstance(fmt, str) and fmt in self.formats and self.assert_format:
            pats.append(self._regex(FORMATS[fmt], False))
            if fmt == "hostname":
                n.max_len = HOSTNAME_CHARS if n.max_len is None else min(n.max_len, HOSTNAME_CHARS)
        n.patterns = tuple(pats)

    def _regex(self, text: str, search: bool) -> int:
        try:
            return compile_pattern(self.pool, text, search)
        except RegexError as exc:
            raise UnsupportedSchemaError(str(exc)) from None

    def _number(self, n: Node, s: dict) -> None:
        def dec(key):
            v = s.get(key)
            if v is None or isinstance(v, bool):
                return None
            try:
                return Decimal(str(v))
            except InvalidOperation:
                raise UnsupportedSchemaError(f"{key} must be a number") from None
        n.lo, n.hi, n.multiple_of = dec("minimum"), dec("maximum"), dec("multipleOf")
        if s.get("exclusiveMinimum") is True:
            n.lo_excl = True
        elif self._boolean_exclusive:  # (draft-04: a flag on minimum, whatever its value's type, as its validator reads it)
            n.lo_excl = bool(s.get("exclusiveMinimum"))
        elif dec("exclusiveMinimum") is not None and (n.lo is None or dec("exclusiveMinimum") >= n.lo):
            n.lo, n.lo_excl = dec("exclusiveMinimum"), True
        if s.get("exclusiveMaximum") is True:
            n.hi_excl = True
        elif self._boolean_exclusive:
            n.hi_excl = bool(s.get("exclusiveMaximum"))
        elif dec("exclusiveMaximum") is not None and (n.hi is None or dec("exclusiveMaximum") <= n.hi):
            n.hi, n.hi_excl = dec("exclusiveMaximum"), True
        if n.multiple_of is not None and n.multiple_of <= 0:
            raise UnsupportedSchemaError("multipleOf must be > 0")
        if n.multiple_of is not None and n.integer_only():
            with localcontext(_EXACT):
                per_unit = Decimal(1) / n.multiple_of
                if per_unit == per_unit.to_integral_value():
                    n.multiple_of = None  # (every integer is a multiple of 1 / k: the digits are read by nothing)

    def _object(self, n: Node, s: dict) -> None:
        n.props = {k: self.node(v) for k, v in (s.get("properties") or {}).items()}
        n.pattern_props = tuple((self._regex(p, True), self.node(v))
                                for p, v in (s.get("patternProperties") or {}).items())
        extra = s.get("additionalProperties", True)
        n.additional = None if extra is False else self.node(extra)
        if n.additional is not None and n.additional.never:
            n.additional = None
        required = s.get("required")  # (a list; draft-03's boolean is read off its parent: dialect.py)
        n.required = frozenset(required) if isinstance(required, list) else frozenset()
        n.min_props = int(s.get("minProperties", 0))
        n.max_props = int(s["maxProperties"]) if "maxProperties" in s else None
        deps = dict(s.get("dependentRequired") or {})
        for k, v in (s.get("dependencies") or {}).items():
            if isinstance(v, list):
                deps[k] = v
            else:  # schema dependencies: checked on the complete object
                _keep_check(n, s, frozenset(("object",)))
        n.dep_required = {k: tuple(v) for k, v in deps.items()}
        names = s.get("propertyNames")
        key = self.node(names) if names is not None else self.any.key_node
        if key.alts is not None and not key.never:
            # a key is read as a plain string rule (no branches): its anyOf / oneOf branches
            # are checked on the key's text at its close (Machine._key_done)
            plain = Node(names)
            plain.types, plain.residual = frozenset(("string",)), names
            key = plain
        if n.additional is None and not n.pattern_props:
            closed = Node({"enum": sorted(n.props)})
            closed.types = frozenset(("string",)) & key.types
            closed.enum = tuple(sorted(k for k in n.props if (key.enum is None or k in key.enum)
                                       and not n.props[k].never))  # (no value: the key is refused)
            closed.min_len, closed.max_len, closed.patterns = key.min_len, key.max_len, key.patterns
            closed.residual = key.residual
            key = closed
        n.key_node = key

    def _array(self, n: Node, s: dict) -> None:
        items = s.get("items")
        prefix = s.get("prefixItems")
        if isinstance(items, list):  # draft <= 2019-09 tuple form
            prefix, items = items, s.get("additionalItems", True)
        n.prefix = tuple(self.node(x) for x in (prefix or ()))
        tail = True if items is None else items
        n.items = self.node(tail)
        if n.items.never:
            n.items = None
        n.min_items = int(s.get("minItems", 0))
        n.max_items = int(s["maxItems"]) if "maxItems" in s else None
        n.unique = bool(s.get("uniqueItems"))

    # ------------------------------------------------------------ kinds no value can be
    def _drop_impossible_kinds(self, n: Node) -> None:
        """The kinds of `n` whose own keywords no value of that kind meets, taken out of its
        types (none left: `never`), and its enums narrowed to the members its lengths and
        patterns (strings), bounds and multipleOf (numbers) take. Each was a dead end: the kind's first byte was offered and then no
        completion was (`{"required": ["a"], "properties": {"a": false}}` took `{` and keys
        forever, `{"minLength": 3, "maxLength": 2}` a string that could not close), and a
        parent whose required member or first items are such a rule could not close either.
        Only what these keywords decide alone is read, and only rules already compiled (one
        still being filled, a reference back to an enclosing schema, counts as possible):
        every rule's structure is a superset of its valid values, so a kind found empty here
        is empty in the schema."""
        gone = set()
        if n.allows_number() and n.num_enum is not None:  # (its members: those its other number keywords take)
            n.num_enum = _numbers_meeting(n)
        if "string" in n.types and not self._strings_possible(n):
            gone.add("string")
        if n.allows_number() and not _numbers_possible(n):
            gone |= {"number", "integer"}
        if "object" in n.types and not self._objects_possible(n):
            gone.add("object")
        if "array" in n.types and not self._arrays_possible(n):
            gone.add("array")
        if gone:
            n.types = n.types - gone

    def _strings_possible(self, n: Node) -> bool:
        if n.max_len is not None and n.min_len > n.max_len:
            return False
        if n.patterns and max(map(self.pool.min_chars, n.patterns)) > (NEVER - 1 if n.max_len is None else n.max_len):
            return False  # (a pattern no text matches, or none within maxLength: `^\d{3}-\d{4}$` under 7)
        if n.enum is None:
            return True
        if sum(map(len, n.enum)) <= ENUM_CHARS_CHECKED:  # (a member a pattern or a length refuses: never complete)
            n.enum = tuple(v for v in n.enum if self._string_fits(n, v))
        return bool(n.enum)

    def _string_fits(self, n: Node, text: str) -> bool:
        """`text` meets string rule `n`'s lengths (code points, as JSON Schema counts) and
        patterns (its enum aside)."""
        if len(text) < n.min_len or (n.max_len is not None and len(text) > n.max_len):
            return False
        return all(self.pool.accepts(term, text) for term in n.patterns)

    def _objects_possible(self, n: Node) -> bool:
        key = n.key_node
        if key is not None and (key.never or "string" not in key.types):  # (no key at all: only `{}`)
            return not n.required and n.min_props == 0
        required = n.still_required()  # (those required and those they bring: dependentRequired)
        if n.max_props is not None and (n.min_props > n.max_props or len(required) > n.max_props):
            return False
        if not all(self._member_possible(n, name) for name in required if isinstance(name, str)):
            return False
        if n.additional is None and not n.pattern_props:  # (closed: the declared names its keys may spell)
            names = n.key_node.enum if n.key_node is not None and n.key_node.enum is not None else n.props
            return n.min_props <= len(names)
        return True

    def _member_possible(self, n: Node, name: str) -> bool:
        """Object rule `n` may hold member `name`: its key rule takes the name (lengths,
        patterns, an enum; a key check aside) and some value meets every rule that applies
        to the member (its property, the patternProperties matching it, else
        additionalProperties)."""
        key = n.key_node
        if key is not None:
            if key.never or "string" not in key.types or (key.enum is not None and name not in key.enum):
                return False
            if key.enum is None and not self._string_fits(key, name):
                return False
        rules = [n.props[name]] if name in n.props else []
        rules += [rule for term, rule in n.pattern_props if self.pool.accepts(term, name)]
        if not rules:
            rules = [n.additional] if n.additional is not None else []
        return bool(rules) and not any(rule.never for rule in rules)

    def _arrays_possible(self, n: Node) -> bool:
        if n.max_items is not None and n.min_items > n.max_items:
            return False
        if any(rule.never for rule in n.prefix[:n.min_items]):  # (those items are there, each of its rule)
            return False
        return n.min_items <= len(n.prefix) or n.items is not None


def _numbers_meeting(n: Node) -> tuple:
    """The members of rule `n`'s numeric enum that meet its bounds and multipleOf (integers,
    where only integers are): every spelling of one is then valid, whatever its mantissa
    (Node.number_prefix_ok)."""
    with localcontext(_EXACT):
        return tuple(v for v in n.num_enum
                     if n.number_ok(str(v)) and (not n.integer_only() or v == v.to_integral_value()))


def _numbers_possible(n: Node) -> bool:
    """Some number meets rule `n`'s bounds (an integer, where only integers are), its
    multipleOf among them where that can be told exactly, and is a member of its numeric
    enum, where it has one."""
    lo, hi = n.lo, n.hi
    try:
        with localcontext(_EXACT):
            if n.num_enum is not None:
                return bool(n.num_enum)  # (narrowed: _numbers_meeting)
            if lo is None or hi is None:
                return True
            if lo > hi or (lo == hi and (n.lo_excl or n.hi_excl)):
                return False
            step = n.multiple_of
            if step is None and n.integer_only():
                step = Decimal(1)
            elif step is not None and n.integer_only() and step != step.to_integral_value():
                return True  # (integers that are multiples of a fraction: not told here)
            if step is None:
                return True
            first = (lo / step).to_integral_value(ROUND_CEILING) * step  # the least multiple >= lo
            if first < lo:  # (a quotient rounded at the context's 2,000 digits)
                first += step
            if first == lo and n.lo_excl:
                first += step
            return first < hi or (first == hi and not n.hi_excl)
    except ArithmeticError:  # (bounds too far apart for exact steps: not told)
        return True


def _takes_every_value(s) -> bool:
    """Schema `s` is one every value meets: `true`, `{}`, annotations only."""
    return s is True or (isinstance(s, dict) and set(s) <= ANNOTATIONS)


def _refers(s) -> bool:
    """A reference keyword is somewhere in `s` (or more than REFS_SCANNED nodes were looked at)."""
    stack, seen = [s], 0
    while stack:
        x = stack.pop()
        seen += 1
        if seen > REFS_SCANNED:
            return True
        if isinstance(x, dict):
            if "$ref" in x or "$dynamicRef" in x or "$recursiveRef" in x:
                return True
            stack.extend(x.values())
        elif isinstance(x, list):
            stack.extend(x)
    return False


# keywords beside which an enum's members need no validation at compile (`type` is read by `_enum`)
_ENUM_ALONE = frozenset(("enum", "const", "type")) | ANNOTATIONS
_CONTAINERS = frozenset(("object", "array"))
# keywords that apply other schemas to the same instance: their annotations reach the
# unevaluated* keywords beside them (JSON Schema 2020-12, 11.2 / 11.3; `not` keeps none: its
# subschema fails wherever the instance is valid)
_IN_PLACE = frozenset(("allOf", "anyOf", "oneOf", "if", "then", "else", "$ref", "$dynamicRef", "$recursiveRef",
                       "dependentSchemas"))
# ... those among them whose annotations depend on which of their subschemas pass
_CONDITIONAL = _IN_PLACE - {"allOf", "$ref"}
_UNEVALUATED = frozenset(("unevaluatedProperties", "unevaluatedItems"))


def _unevaluated_locally(s: dict) -> dict:
    """`s` with unevaluatedProperties / unevaluatedItems as the structure they are where
    no in-place applicator sits beside them (nothing but this schema object's own
    properties / patternProperties / additionalProperties, prefixItems / items, evaluates
    a member): additionalProperties (additionalItems, items) where that keyword is absent,
    nothing where it is present (it evaluates every member left). Else `s` itself (the
    keywords stay checks on the complete value)."""
    if _IN_PLACE & set(s) or not ("unevaluatedProperties" in s or "unevaluatedItems" in s):
        return s
    out = dict(s)
    if "unevaluatedProperties" in out:
        out.setdefault("additionalProperties", out.pop("unevaluatedProperties"))
    if "unevaluatedItems" in out and "contains" not in out:  # (contains evaluates the items it matches)
        rest = out.pop("unevaluatedItems")
        if isinstance(out.get("items"), list):  # (the tuple form: additionalItems evaluates the rest)
            out.setdefault("additionalItems", rest)
        else:
            out.setdefault("items", rest)
    return out


# the keywords that assert something of one kind of value only (any other passes it)
_KIND_WORDS = {
    "array": frozenset(("items", "prefixItems", "additionalItems", "contains", "minContains", "maxContains",
                        "unevaluatedItems", "minItems", "maxItems", "uniqueItems")),
    "object": frozenset(("properties", "patternProperties", "additionalProperties", "propertyNames",
                         "minProperties", "maxProperties", "required", "dependentRequired", "dependentSchemas",
                         "dependencies", "unevaluatedProperties")),
    "string": frozenset(("minLength", "maxLength", "pattern", "format", "contentMediaType", "contentEncoding",
                         "contentSchema")),
    "number": frozenset(("multipleOf", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")),
}
_KIND_OF_WORD = {word: kind for kind, words in _KIND_WORDS.items() for word in words}


def _kinds(types) -> frozenset:
    """JSON Schema type names as value kinds (integer counted as number)."""
    return frozenset("number" if t == "integer" else t for t in types)


def _type_names(s: dict) -> Optional[list]:
    """The names schema `s`'s `type` lists where all are JSON Schema types, else None."""
    kind = s.get("type")
    names = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else None
    return names if names is not None and all(k in ALL_TYPES for k in names) else None


def _checked_kinds(checked: set, s: dict) -> Optional[frozenset]:
    """The value kinds a node's check may refuse, given the keywords `checked` it is kept
    for (the structure states the rest of schema `s` exactly): those that each keyword
    asserts something of (`contains` only of arrays, `dependentSchemas` only of objects ...;
    `if` with neither `then` nor `else` of none: `_conditional_kinds`; `not S` of the kinds
    S accepts some value of: `_possible_kinds`), or None where a keyword asserts of every
    kind (one not known here). A value of another kind passes the check whatever it is,
    so the matcher does not capture it. (oneOf's "exactly one": `_shared_kinds`.)"""
    kinds: set = set()
    for word in checked:
        if word == "if":  # (with then / else: the kinds a branch that applies may refuse)
            kinds |= _conditional_kinds(s)
            continue
        if word == "not":  # (`not S` refuses values only of the kinds S accepts some of)
            kinds |= _possible_kinds(s["not"])
            continue
        kind = _KIND_OF_WORD.get(word)
        if kind is None:
            return None
        kinds.add(kind)
    return frozenset(kinds)


_ALL_KINDS = frozenset(("string", "number", "object", "array", "boolean", "null"))
_COMBINED = frozenset(("not", "allOf", "anyOf", "oneOf"))


# not {word: x} for a bound: a number (the bound passes any other kind) past the other side
_NOT_BOUND = {"minimum": "exclusiveMaximum", "maximum": "exclusiveMinimum", "exclusiveMinimum": "maximum",
              "exclusiveMaximum": "minimum"}
_LOWER = frozenset(("minimum", "exclusiveMinimum"))
_TYPE_ORDER = ("null", "boolean", "object", "array", "number", "integer", "string")


def _not_decided_early(s: dict, bounds: bool = True):
    """`s` with a `not` of one keyword whose complement the structure states exactly
    rewritten as that complement (False where that leaves no kind of value: `{"type":
    "string", "not": {"required": ["a"]}}`, as a string passes `required`), else `s`: `not {type: T}` is the other types (but for
    `integer` alone: no type says "a number that is not an integer"), `not {minimum: x}`
    is a number below x (`type`
    narrowed to numbers, `exclusiveMaximum: x`; the other three bounds alike; only where
    `bounds`: draft-06 on, whose exclusive bounds are numbers), `not {required: [k]}` an object without member k
    (`type` narrowed to objects, `properties {k: false}`: the key refused at its closing
    quote), `not {required: [k1, k2 ...]}` (NOT_REQUIRED_NAMES at most, no anyOf beside it)
    an object without one of them at least (anyOf branches, each `properties {ki: false}`,
    followed side by side: the last name's key refused at its close). A check at the
    value's end decides the same, but only there: the mask let a value start that nothing
    could end (`"` under `not {type: string}`, a string never closed; `5` under `not
    {minimum: 0}`, a number growing to its cap; a member `k` under `not {required: [k]}`, or
    both names under `not {required: [k1, k2]}`, an object that could never close)."""
    sub = s["not"]
    if not isinstance(sub, dict):
        return s
    words = set(sub) - ANNOTATIONS
    if len(words) != 1:
        return s
    (word,) = words
    v = sub[word]
    if word in _NOT_BOUND and bounds and isinstance(v, (int, float)) and not isinstance(v, bool):
        out = _narrowed(s, ("number", "integer"))
        if out is None:
            return s
        if out is False:
            return False
        bound = _NOT_BOUND[word]
        have = out.get(bound)
        if isinstance(have, (int, float)) and not isinstance(have, bool):  # (the tighter of the two)
            v = max(v, have) if bound in _LOWER else min(v, have)
        elif have is not None:
            return s
        out[bound] = v
        return out
    if word == "type":
        names = _type_names(sub)
        if names is None:
            return s
        gone = set(names) | ({"integer"} if "number" in names else set())
        if "integer" in gone and "number" not in gone:
            return s  # (a number that is not an integer: no type says it)
        out = _narrowed(s, tuple(t for t in _TYPE_ORDER if t not in gone))
        return s if out is None else out
    if word == "required" and isinstance(v, list) and v and all(isinstance(k, str) for k in v):
        names = list(dict.fromkeys(v))
        out = _narrowed(s, ("object",))
        if out is False:
            return out
        props = out.get("properties", {}) if out is not None else None
        if not isinstance(props, dict):
            return s
        if len(names) == 1:
            out["properties"] = {**props, names[0]: False}
            return out
        if len(names) > NOT_REQUIRED_NAMES or "anyOf" in out or "unevaluatedProperties" in out:
            return s
        # (each branch the object's member keywords with one name refused: they merge with
        # the rest as they stand; the object dies at the close of the last name's key)
        members = {k: out.pop(k) for k in _OBJECT_SCOPED if k in out}
        out["anyOf"] = [{**members, "properties": {**props, k: False}} for k in names]
        return out
    return s


def _types_disjoint(a, b) -> bool:
    """Schemas `a` and `b` both name types, and none in common (integer is a number)."""
    if not (isinstance(a, dict) and isinstance(b, dict) and "type" in a and "type" in b):
        return False
    ta, tb = _type_names(a), _type_names(b)
    return ta is not None and tb is not None and not _kinds(ta) & _kinds(tb)


def _one_of_kinds(s: dict, alts: list):
    """`s` with its `type` narrowed to the kinds (integer counted as number) that fewer than
    two of its oneOf branches `alts` (bare references followed) take every value of, False
    where that leaves none, `s` where no kind goes (or its `type` is not names): a value of
    such a kind meets two branches, so not exactly one (`{"oneOf": [{"required": ["a"]},
    {"required": ["b"]}]}` is an object: a string passes both; before, `"` was begun and
    refused at the string's end)."""
    counts: dict = {}
    for alt in alts:
        for kind in _every_value_kinds(alt):
            counts[kind] = counts.get(kind, 0) + 1
    gone = {kind for kind, c in counts.items() if c > 1}
    return _typed_within(s, _ALL_KINDS - gone) if gone else s


def _kinds_narrowed(s: dict):
    """`s` with its `type` (every type where it has none) narrowed to the kinds its `not`,
    allOf, anyOf and oneOf leave some value of (`_possible_kinds`, a superset: exact), False
    where none is left, `s` where nothing goes (or its `type` is not names). The checks on
    the complete value decide the same, but only at its end: `{"$ref": ..., "not": {"pattern":
    "b"}}` (every non-string passes the pattern, so fails the `not`) took `{`, and nothing could
    close it; `{"anyOf": [{"const": "abc"}], "properties": ...}` too."""
    return _typed_within(s, _possible_kinds(s)) if _COMBINED & set(s) else s


def _typed_within(s: dict, kinds: frozenset):
    """`s` with its `type` (every type where it has none) narrowed to the value kinds
    `kinds` (integer counted as number), False where that leaves none, `s` where none goes
    (or its `type` is not names)."""
    names = _type_names(s) if "type" in s else list(_TYPE_ORDER)
    if names is None:
        return s
    kept = [t for t in names if _kinds((t,)) & kinds]
    if not kept:
        return False
    if len(kept) == len(names):
        return s
    return {**s, "type": kept[0] if len(kept) == 1 else kept}


def _with_types(part, s: dict):
    """Schema `part` with its `type` narrowed to the types `s` names too (integer within
    number), `part` where `s` names none or nothing goes; False where no type is left."""
    names = _type_names(s) if "type" in s else None
    if names is None or not (part is True or isinstance(part, dict)):
        return part
    own = _type_names(part) if part is not True and "type" in part else list(_TYPE_ORDER)
    if own is None:
        return part
    both = intersect_types(set(own), set(names))
    kept = [t for t in _TYPE_ORDER if t in both]
    if not kept:
        return False
    if len(kept) == len(own):
        return part
    return {**(part if part is not True else {}), "type": kept[0] if len(kept) == 1 else kept}


def _narrowed(s: dict, kinds: tuple):
    """`s` less its `not`, its `type` (every type where it has none) narrowed to the type
    names `kinds`; False where it names none of them (no value: the `not` refuses every
    kind it allows), None where its `type` is not a list of type names."""
    out = {k: x for k, x in s.items() if k != "not"}
    names = _type_names(s) if "type" in s else list(kinds)
    if names is None:
        return None
    kept = [t for t in names if t in kinds]
    if not kept:
        return False
    out["type"] = kept[0] if len(kept) == 1 else kept
    return out


def _possible_kinds(s, depth: int = 0) -> frozenset:
    """A superset of the value kinds (integer counted as number) schema `s` accepts some
    value of, read off `type`, `const`, `enum` and the combinators (every kind where it
    cannot tell: a `$ref`, a keyword not known here)."""
    if s is False:
        return frozenset()
    if not isinstance(s, dict) or depth > 32:
        return _ALL_KINDS
    out = _ALL_KINDS - _every_value_kinds(s["not"]) if "not" in s else _ALL_KINDS
    names = _type_names(s)
    if names is not None:
        out &= _kinds(names)
    members = [s["const"]] if "const" in s else s.get("enum") if isinstance(s.get("enum"), list) else None
    if members is not None:
        out &= _kinds(k for v in members for k in _json_type(v))
    for part in s.get("allOf") if isinstance(s.get("allOf"), list) else ():
        out &= _possible_kinds(part, depth + 1)
    for combo in ("anyOf", "oneOf"):
        if isinstance(s.get(combo), list):
            out &= frozenset().union(*(_possible_kinds(part, depth + 1) for part in s[combo]))
    return frozenset(out)


def _bounded(s, bound: Optional[tuple]):
    """Schema `s` (a merge, no additionalProperties) with the members no name or pattern of
    `bound` (SchemaCompiler._unevaluated_bound) covers held to its schema: those declared
    elsewhere are declared here too, as any value."""
    if bound is None or not isinstance(s, dict) or "additionalProperties" in s:
        return s
    names, patterns, rest = bound
    out = dict(s)
    props = dict(s.get("properties") or {})
    for k in names - set(props):
        props[k] = True
    pats = dict(s.get("patternProperties") or {})
    for p in patterns - set(pats):
        pats[p] = True
    out["properties"], out["additionalProperties"] = props, rest
    if pats:
        out["patternProperties"] = pats
    return out


def _keep_check(n: Node, s, kinds: Optional[frozenset]) -> None:
    """Node n checked on schema `s` for values of `kinds` (None: every kind), joined with a
    check kept on it before (the whole schema is checked: for the kinds of both reasons)."""
    if n.residual is not None:
        kinds = None if kinds is None or n.checked_kinds is None else n.checked_kinds | kinds
    n.residual, n.checked_kinds = s, kinds


def _enum_kinds(values) -> frozenset:
    """The kinds of an enum's values the structure does not decide exactly (numbers,
    objects, arrays: compared on the complete value; strings, booleans, null are exact)."""
    out = set()
    for v in values:
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out.add("number")
        elif isinstance(v, (dict, list)):
            out.add("object" if isinstance(v, dict) else "array")
    return frozenset(out)


def _conditional_kinds(s: dict) -> frozenset:
    """The kinds `if` / `then` / `else` may refuse a value of: not those where both branches
    that apply accept every value (`_every_value_kinds`; a missing one accepts all), nor
    those `if` accepts no value of and `else` accepts all of, nor those `if` accepts every
    value of and `then` accepts all of."""
    then = _ALL_KINDS if "then" not in s else _every_value_kinds(s["then"])
    other = _ALL_KINDS if "else" not in s else _every_value_kinds(s["else"])
    some, every = _possible_kinds(s["if"]), _every_value_kinds(s["if"])
    return frozenset(k for k in _ALL_KINDS
                     if not ((k in then and k in other) or (k not in some and k in other)
                             or (k in every and k in then)))


def _every_value_kinds(s) -> frozenset:
    """A subset of the value kinds schema `s` accepts every value of: all for `true` / `{}`;
    else, where each of its keywords is `type` or asserts of one kind only (_KIND_WORDS),
    the kinds its `type` allows (integer: not every number) less those its other keywords
    assert of; none where it has another keyword (not told here)."""
    if s is True:
        return _ALL_KINDS
    if not isinstance(s, dict):
        return frozenset()
    words = set(s) - ANNOTATIONS
    kinds = _ALL_KINDS
    if "type" in words:
        names = _type_names(s)
        if names is None:
            return frozenset()
        kinds = frozenset(k for k in names if k in _ALL_KINDS)  # (integer: not every number)
        words.discard("type")
    for word in words:
        kind = _KIND_OF_WORD.get(word)
        if kind is None:
            return frozenset()
        kinds = kinds - {kind}
    return kinds


def _scalar_signature(n: Node) -> tuple:
    """What the matcher reads of a rule whose values are scalars (no object, no array, no
    choice, no check): nodes alike in all of it accept the same texts the same way."""
    return (n.types, n.literals, n.min_len, n.max_len, n.patterns, n.enum, n.lo, n.lo_excl, n.hi, n.hi_excl,
            n.multiple_of, n.integer, n.num_enum)


def _exclusive(alts) -> bool:
    """No JSON value matches two of the branches: at most one then matches any value, so
    oneOf's "exactly one" is anyOf's "at least one" and needs no check on the complete
    value. Two branches exclude each other where no value is of a type both take (integer
    counting as number: `{"oneOf": [{"type": "string"}, {"type": "null"}]}`, the usual
    nullable), or where both are objects that require a property whose strings in one
    share no member with those in the other (a discriminator: `{"type": {"enum": ["a"]}}`
    against `{"type": {"const": "b"}}`)."""
    if any(a.alts for a in alts):
        return False
    kinds = [_kinds(a.types) for a in alts]
    return all(not (kinds[i] & kinds[j]) or _discriminated(alts[i], alts[j])
               for i in range(len(alts)) for j in range(i + 1, len(alts)))


def _shared_kinds(alts) -> Optional[frozenset]:
    """The value kinds (integer counted as number) that two or more of oneOf's branches
    take, or None where a branch is itself a choice: a value of another kind matches at
    most one branch, so "exactly one" is "at least one" for it, which the structure states."""
    if any(a.alts for a in alts):
        return None
    counts: dict = {}
    for a in alts:
        for kind in _kinds(a.types):
            counts[kind] = counts.get(kind, 0) + 1
    return frozenset(k for k, c in counts.items() if c > 1)


def _discriminated(a: Node, b: Node) -> bool:
    """Objects `a` and `b` both require a property whose values are strings of an enum in
    each, and the enums share none (a branch's checks only narrow its enum further)."""
    if a.types != {"object"} or b.types != {"object"}:
        return False
    for name in a.required & b.required:
        ea, eb = _string_enum(a.props.get(name)), _string_enum(b.props.get(name))
        if ea is not None and eb is not None and not set(ea) & set(eb):
            return True
    return False


def _string_enum(v: Optional[Node]) -> Optional[tuple]:
    """The strings a value of `v` may be, where it may be nothing else (else None)."""
    if v is not None and v.alts is None and v.types == {"string"} and v.enum is not None:
        return v.enum
    return None


def _enum_as_choice(s: dict) -> Optional[dict]:
    """An enum / const holding objects or arrays as `anyOf` of their literal structures (each
    object's keys required and no others, each array's items in place) plus one branch of its
    other values; None when there are none (or they nest too deep to spell out). The
    structure keeps a model from writing an object or array no value of the enum matches;
    the enum itself is still decided on the complete value (residual)."""
    if "const" in s and "enum" in s:
        return None
    values = [s["const"]] if "const" in s else s.get("enum")
    if not isinstance(values, list) or not any(isinstance(v, (dict, list)) for v in values):
        return None
    names = _type_names(s) if "type" in s else None
    if names is not None:  # (a value not of the schema's type is none of its instances: no branch of its own)
        values = [v for v in values if _json_type(v) & set(names)]
    try:
        alts = [_literal_schema(v, 0) for v in values if isinstance(v, (dict, list))]
    except RecursionError:
        return None
    scalars = [v for v in values if not isinstance(v, (dict, list))]
    if scalars:
        alts.append({"enum": scalars})
    return {**{k: v for k, v in s.items() if k not in ("enum", "const")}, "anyOf": alts}


def _literal_schema(v, depth: int) -> dict:
    """The schema whose only instances equal the JSON value v (JSON Schema equality)."""
    if depth > 64:
        raise RecursionError("constant nested too deep")
    if isinstance(v, dict):
        return {"type": "object", "properties": {k: _literal_schema(x, depth + 1) for k, x in v.items()},
                "required": list(v), "additionalProperties": False}
    if isinstance(v, list):
        return {"type": "array", "prefixItems": [_literal_schema(x, depth + 1) for x in v], "items": False,
                "minItems": len(v)}
    return {"enum": [v]}  # (not `const`: draft-04 and older have none, and would leave v unchecked)


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b or (isinstance(a, (int, float)) and isinstance(b, (int, float))
                                               and not isinstance(a, bool) and not isinstance(b, bool) and a == b)


_ARRAY_SCOPED = ("prefixItems", "items", "additionalItems")
_OBJECT_SCOPED = ("properties", "patternProperties", "additionalProperties")


_DYNAMIC_DROPPED = frozenset(("$dynamicRef", "$recursiveRef", "unevaluatedProperties", "unevaluatedItems"))
_ADJACENT = (("if", "then", "else"), ("contains", "minContains", "maxContains"))


def _mergeable(parts) -> bool:
    """Merging keeps the meaning: no `unevaluated*` (they see sibling keywords), no
    item / member keywords split over two parts (`items` applies past *its own* schema's
    `prefixItems`, `additionalProperties` past its own `properties`), and no keywords that
    act only beside each other in two parts (`then` / `else` beside `if`, `minContains` /
    `maxContains` beside `contains`: joined, a part's lone `then` would start to apply)."""
    dicts = [p for p in parts if isinstance(p, dict)]
    if any("unevaluatedProperties" in p or "unevaluatedItems" in p for p in dicts):
        return False
    for group in _ADJACENT:
        if sum(1 for p in dicts if any(k in p for k in group)) > 1:
            return False
    for scoped in (_ARRAY_SCOPED, _OBJECT_SCOPED):
        owners = [p for p in dicts if any(k in p for k in scoped)]
        if len(owners) > 1 and any(scoped[-1] in p or (scoped[1] in p and scoped is _ARRAY_SCOPED)
                                   for p in owners):
            return False
    return True


def _has_ref_cycle(merged, original) -> bool:
    return merged is original


def _reachable_nodes(root: Node):
    """Every node reachable from `root` through member, item, key and choice rules."""
    seen, stack = set(), [root]
    while stack:
        n = stack.pop()
        if n is None or id(n) in seen:
            continue
        seen.add(id(n))
        yield n
        stack.extend(n.props.values())
        stack.extend(v for _, v in n.pattern_props)
        stack.extend((n.additional, n.key_node, n.items, *n.prefix, *(n.alts or ())))
