"""Speculator: which running requests draft this step, how many tokens, and what the
grammar allows at every drafted position. The draft source (base.py) proposes; this
part bounds, trims and accounts.

A request drafts when its only pending token is its last output token (a plain decode
step), it has reached min_new_tokens, it uses no frequency / presence / repetition
penalty (those would change between drafted positions), and at least 2 output tokens
are left (k drafts produce up to k + 1 tokens; k <= remaining - 1 keeps max_new_tokens).

Turning itself down, by measured cost (cost.py; docs/speculative.md "Turning itself
down"): a batch size whose plain decode step time is not yet measured runs plain steps
until it is (they cost what a plain engine's steps cost). Once its plain and verify step
times are both measured, a request drafts the longest k whose k-th draft token is still
worth its cost (a^k * c >= m), and a step verifies only when its drafts' expected gain
beats the verify's cost; when even full drafts could not pay, nothing is proposed. A
request that does not verify keeps a shadow draft (shadow.py) checked against the tokens
its plain steps produce, so its acceptance keeps being measured at no verify cost. Until
the verify costs are measured, the heuristic (per request, `DraftBudget`): the draft length starts at
INITIAL_DRAFTS; after a verify that accepted a of k drafts it becomes a + 1 (fewer wasted
positions next time), and it doubles (up to the maximum) after a fully accepted one.
After 2 verifies in a row that accepted nothing the request stops drafting for 2 steps,
then 4, 8, up to COOLDOWN_MAX steps while the misses continue; one accepted draft resets
this. A source that finds nothing (no n-gram match) costs only its lookup: the step is a
plain decode. Per step, all drafts together are capped (CPU_STEP_DRAFT_TOKENS on a CPU,
where a forward of many tokens costs like a prefill); the requests with the best recent
acceptance keep theirs first.

Constrained requests: a source that asks (`guided`) drafts only what the grammar allows
(guide.py, rolled back after the call); any draft is cut at the first token the grammar
forbids, and before any token after which the grammar terminates (that token may still
come as the verify step's bonus token, where `on_token` handles it as a plain step
would). A draft runs on through text the grammar forces (its tokens are the model's own
earlier tokenization of it, which the model accepts more often than the forced text's
canonical tokens). Where jump-forward forces text this step, the request's draft is its
own one if that goes past the forced text, else the forced tokens followed by the
source's continuation after them (`prefixes`), else the forced text alone. The mask of
every drafted position (and of the bonus position) is written here, with the matcher
advanced through the draft and rolled back exactly.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

from lmprog_runtime.scheduler.batch import PlannedDraft
from lmprog_runtime.scheduler.faults import Stage, fail_request
from lmprog_runtime.scheduler.jump_forward import grammar_draft
from lmprog_runtime.speculative.cost import Acceptance, StepCost, draft_length, worth_it
from lmprog_runtime.speculative.guide import GrammarGuide
from lmprog_runtime.speculative.shadow import Shadow, make_shadow
from lmprog_runtime.speculative.tree import chain_parents, depths, grammar_tree_draft, well_formed

logger = logging.getLogger(__name__)

INITIAL_DRAFTS = 4    # a request's first draft length (doubles after each fully accepted one)
COOLDOWN_MISSES = 2   # verifies in a row with no accepted draft before drafting pauses
COOLDOWN_MAX = 32     # longest pause, in steps
RATE_DECAY = 0.7      # acceptance-rate EMA per verify (ranks requests for the step cap)
# Draft tokens of all requests in one verify forward. A forward stays about as cheap as a
# decode only while its tokens are few for the device; past that every rejected draft costs.
CPU_STEP_DRAFT_TOKENS = 48
GPU_STEP_DRAFT_TOKENS = 1024


SHADOW_TOKENS = 4     # length of a shadow draft (shadow.py): an idled request's acceptance, measured
SHADOW_GAP = 8        # output tokens between a decided shadow and the next (each costs a lookup);
                      # x 4 for a source whose proposal runs a forward (a draft model)


class DraftBudget:
    """One request's adaptive draft length (see the module docstring)."""

    __slots__ = ("k", "misses", "cooldown", "rate", "acc", "shadow", "shadow_after")

    def __init__(self, k: int, acc: Optional[Acceptance] = None):
        self.k = k
        self.misses = 0
        self.cooldown = 0
        self.rate = 0.5  # EMA of accepted / proposed
        self.acc = acc or Acceptance()  # per-position acceptance, for the cost rule
        self.shadow: Optional[Shadow] = None  # a draft not verified, checked against the output
        self.shadow_after = 0  # output length before which no new shadow is drafted

    def update(self, proposed: int, accepted: int, max_k: int) -> None:
        self.acc.update(proposed, accepted)
        self.rate = RATE_DECAY * self.rate + (1 - RATE_DECAY) * accepted / proposed
        self.k = min(max_k, 2 * self.k) if accepted == proposed else max(1, accepted + 1)
        if accepted:
            self.misses = 0
            return
        self.misses += 1
        if self.misses >= COOLDOWN_MISSES:
            self.cooldown = min(2 ** (self.misses - COOLDOWN_MISSES + 1), COOLDOWN_MAX)


def eligible(r) -> bool:
    sp = r.sampling
    return (not r.finished and r.extend_len == 1 and r.kv_len >= r.prompt_len and r.output_ids
            and len(r.output_ids) >= r.min_new_tokens and r.max_new_tokens - len(r.output_ids) >= 2
            and sp.frequency_penalty == 0 and sp.presence_penalty == 0 and sp.repetition_penalty == 1.0
            and (r.grammar is None or not r.grammar.is_terminated()))


class Speculator:
    def __init__(self, spec, source, vocab_size: int, jump_forward: bool, stats: dict, faults=None,
                 step_draft_tokens: int = CPU_STEP_DRAFT_TOKENS, cost_rule: bool = True):
        self.spec = spec          # SpecConfig
        self.step_draft_tokens = max(step_draft_tokens, spec.max_drafts)  # cap per verify forward
        self.source = source      # DraftSource
        self.vocab_size = vocab_size
        self.jump_forward = jump_forward  # jump-forward on: forced text may start a draft (`_choose`)
        self.stats = stats        # adds spec_num_verify, spec_num_draft_tokens, spec_num_accepted_tokens
        self.faults = faults
        self.budgets: Dict[str, DraftBudget] = {}
        stats.update(spec_num_verify=0, spec_num_draft_tokens=0, spec_num_accepted_tokens=0,
                     spec_num_tree_moves=0, spec_num_steps_declined=0, spec_num_steps_heuristic=0,
                     spec_num_steps_calibrating=0, spec_num_steps_drafted=0, spec_num_shadow_drafts=0,
                     spec_num_shadow_accepted=0)
        self.cost = StepCost()       # measured step times → the cost rule (cost.py)
        self.cost_rule = cost_rule   # False: the budgets' own heuristic always decides
        self.accept = Acceptance()   # all requests' acceptance: a new request's prior

    # -- before admission ---------------------------------------------------------------------
    def propose(self, running: List, forced: Optional[Dict[int, PlannedDraft]] = None) -> Dict[int, PlannedDraft]:
        """id(req) → its draft, for the running requests that draft this step. `forced`: the
        jump-forward drafts of this step (id(req) → forced text); such a request gets a draft
        here only where it beats the forced text alone (see `_choose`), and it replaces it."""
        forced = forced or {}
        model, calibrating = self._model(sum(not r.finished for r in running))
        plans, idle = self._plans(running, model, calibrating)
        self.stats["spec_num_steps_calibrating"] += calibrating and bool(idle)
        if plans and model is not None and not self._could_pay(model, plans, forced):
            self.stats["spec_num_steps_declined"] += 1
            idle, plans = idle + [r for r, _ in plans], []
        shadows = [r for r in idle if self._wants_shadow(r)] if self.cost_rule else []
        if not plans and not shadows:
            return {}
        found = self._drafts(plans, forced, shadows)
        if found and model is not None and not self._pays(model, found, bool(forced)):
            self.stats["spec_num_steps_declined"] += 1
            # not a draft after forced text: that is verified this step and may be rejected
            self._shadow([(r, d.tokens, d.parents) for r, d in found if not d.num_forced])
            return {}
        self._count_step(found, model)
        return {id(r): d for r, d in self._cap(found)}

    def _model(self, batch: int):
        """(the cost model or None, calibrating): with the rule on and no plain step time
        measured at this batch size, the step runs plain (costs nothing a plain engine
        would not) until it is (`cost.MIN_PLAIN` steps); then, until the verify costs are
        measured too, the heuristic decides."""
        if not self.cost_rule:
            return None, False
        model = self.cost.model(batch)
        return model, model is None and not self.cost.plain_known(batch)

    def _plans(self, running: List, model, calibrating: bool):
        """([(req, draft depth > 0)], [eligible requests that do not draft]); shadow drafts
        of the running requests are checked against their outputs first (shadow.py)."""
        plans, idle = [], []
        for r in running:
            if not eligible(r):
                continue
            b = self._budget(r)
            if b.shadow is not None:
                self._check_shadow(b, r.output_ids)
            depth = 0 if calibrating else self._depth(b, model)
            if depth:
                plans.append((r, depth))
            else:
                idle.append(r)
        return plans, idle

    def _drafts(self, plans: List, forced: dict, shadows: List) -> List:
        """[(req, PlannedDraft)] for `plans` (grammar-trimmed, joined with forced text); the
        `shadows` requests' drafts (SHADOW_TOKENS, same source call) become their shadows."""
        reqs, budgets, prefixed = [], [], []
        for r, depth in plans:
            nodes = depth * self.spec.topk  # a tree of depth ~k has room for alternatives at each level
            k = min(nodes, self.spec.max_drafts, r.max_new_tokens - len(r.output_ids) - 1)
            reqs.append(r)
            budgets.append(k)
            f = forced.get(id(r))
            if f is not None and k > len(f.tokens):
                prefixed.append((r, f, k - len(f.tokens)))
        n = len(reqs)
        reqs += shadows
        budgets += [min(SHADOW_TOKENS, self.spec.max_drafts)] * len(shadows)
        drafts = self._propose(reqs, budgets)
        self._shadow([(r, d.tokens, d.parents) for r, d in zip(shadows, drafts[n:]) if d is not None])
        own = dict(zip(map(id, reqs[:n]), drafts[:n]))
        after = {}
        if prefixed:
            conts = self._propose([r for r, _, _ in prefixed], [k for _, _, k in prefixed],
                                  [f.tokens for _, f, _ in prefixed])
            after = {id(r): c for (r, _, _), c in zip(prefixed, conts)}
        found = []
        for r, k in zip(reqs[:n], budgets[:n]):
            if r.finished:
                continue
            draft = self._choose(r, k, own.get(id(r)), forced.get(id(r)), after.get(id(r)))
            if draft is not None:
                found.append((r, draft))
        return found

    def _count_step(self, found: List, model) -> None:
        """Which part decided a step that verifies drafts: the heuristic or the rule."""
        if found:
            self.stats["spec_num_steps_drafted"] += 1
            self.stats["spec_num_steps_heuristic"] += model is None

    def _budget(self, r) -> DraftBudget:
        b = self.budgets.get(r.rid)
        if b is None:
            b = self.budgets[r.rid] = DraftBudget(min(self.spec.max_drafts, INITIAL_DRAFTS), self.accept.seed())
        return b

    def _depth(self, b: DraftBudget, model) -> int:
        """How deep a request drafts this step: by the cost rule (cost.py) once the step
        times of this batch size are known, else by the budget's own heuristic; 0 = not at all."""
        if model is None:
            if b.cooldown:
                b.cooldown -= 1
                return 0
            return b.k
        c, _, m = model
        return draft_length(b.acc.rate, c, m, self.spec.max_drafts)

    def _could_pay(self, model, plans: List, forced: dict) -> bool:
        """Would the step pay even if every request found a full draft? If not, nothing is
        proposed (the n-gram lookups and grammar walks of a step the rule would decline)."""
        bound = []
        for r, depth in plans:
            k = min(depth, r.max_new_tokens - len(r.output_ids) - 1)
            bound.append((self.budgets[r.rid].acc.rate, k, min(k * self.spec.topk, self.spec.max_drafts)))
        return worth_it(model, bound, sunk=bool(forced))

    def _pays(self, model, found: List, sunk: bool) -> bool:
        """The step's drafts together are worth their verify cost (cost.worth_it); `sunk`:
        the step verifies forced text anyway, so its fixed cost is paid already."""
        plans = []
        for r, d in found:
            spec = len(d.tokens) - d.num_forced
            depth = spec if d.parents is None else max(depths(d.parents)) - d.num_forced
            plans.append((self.budgets[r.rid].acc.rate, depth, spec))
        return worth_it(model, plans, sunk=sunk)

    def _shadow(self, drafts) -> None:
        """(req, tokens, parents) drafts that will not be verified: shadows (shadow.py)."""
        for r, tokens, parents in drafts:
            b = self.budgets.get(r.rid)
            if b is not None:
                b.shadow = b.shadow or make_shadow(len(r.output_ids), tokens, parents)

    def _wants_shadow(self, r) -> bool:
        b = self.budgets[r.rid]
        return b.shadow is None and len(r.output_ids) >= b.shadow_after

    def _check_shadow(self, b: DraftBudget, output_ids) -> None:
        """A decided shadow counts as a verify would for the request's acceptance."""
        got = b.shadow.resolve(output_ids)
        if got is not None:
            b.shadow = None
            b.shadow_after = len(output_ids) + SHADOW_GAP * (1 if self.source.cheap else 4)
            b.acc.update(*got)
            self.accept.update(*got)
            self.stats["spec_num_shadow_drafts"] += 1
            self.stats["spec_num_shadow_accepted"] += got[1]

    def observe_step(self, plan, seconds: float) -> None:
        """A finished step's wall time, for the cost model: only steps of decodes and verifies."""
        drafts = 0
        for it in plan.items:
            if it.num_tokens - it.num_draft > 1:
                return  # a prefill chunk: not a decode-or-verify step
            drafts += it.num_draft
        self.cost.observe(len(plan.items), drafts, seconds)

    def _choose(self, r, k: int, own, f: Optional[PlannedDraft], cont) -> Optional[PlannedDraft]:
        """The request's own draft, grammar-trimmed; with forced text `f`: the own draft if it
        goes past the forced text (it spells it in the model's own tokens), else the forced
        tokens followed by the source's continuation after them, else None (f stays)."""
        mine = None
        if own is not None and own.tokens:
            mine = self._trim(r, _planned(own).prefix(k))
        if f is None:
            return mine
        if mine is not None and len(mine.tokens) > len(f.tokens):
            return mine
        if cont is None or not cont.tokens or r.finished:
            return None
        nf, cont = len(f.tokens), _planned(cont)
        parents = None if cont.parents is None else chain_parents(nf) + [
            p + nf if p >= 0 else nf - 1 for p in cont.parents]
        joined = self._trim(r, PlannedDraft(f.tokens + cont.tokens, parents=parents,
                                            num_forced=nf).prefix(nf + k))
        return joined if joined is not None and len(joined.tokens) > nf else None

    def _cap(self, found: List) -> List:
        """At most `step_draft_tokens` draft tokens in all: the requests whose drafts were
        accepted most often recently get theirs first."""
        if sum(len(d.tokens) for _, d in found) <= self.step_draft_tokens:
            return found
        found = sorted(found, key=lambda rd: -self.budgets[rd[0].rid].rate)
        left, kept = self.step_draft_tokens, []
        for r, draft in found:
            if left <= 0:
                break
            kept.append((r, draft.prefix(left)))
            left -= len(kept[-1][1].tokens)
        return kept

    def _propose(self, reqs: List, budgets: List[int], prefixes=None) -> list:
        """The source's drafts; if the batched call fails, each request alone (a request
        whose own call fails finishes with an error)."""
        guides = self._guides(reqs, prefixes)
        try:
            return self._propose_guided(reqs, budgets, prefixes, guides)
        finally:
            for g in guides or ():
                if g is not None:
                    g.close()

    def _guides(self, reqs: List, prefixes) -> Optional[List[Optional[GrammarGuide]]]:
        """Per request its grammar's guide (after its prefix), for a source that asks one."""
        if not getattr(self.source, "guided", False):  # duck-typed sources (tests) ask none
            return None
        return [None if r.grammar is None else GrammarGuide(r.grammar, self.vocab_size, prefixes[i] if prefixes else ())
                for i, r in enumerate(reqs)]

    def _propose_guided(self, reqs: List, budgets: List[int], prefixes, guides) -> list:
        """`_propose` with the guides made: the batched call, else one request at a time."""
        extra = {} if prefixes is None else {"prefixes": prefixes}
        if guides is not None:
            extra["guides"] = guides
        try:
            if self.faults is not None:
                self.faults.check_any(Stage.DRAFT, [r.rid for r in reqs], spend=False)
            return self.source.propose(reqs, budgets, **extra)
        except Exception:
            logger.exception("draft source failed for %d requests; retrying one by one", len(reqs))
        drafts = []
        for i, (r, k) in enumerate(zip(reqs, budgets)):
            try:
                if self.faults is not None:
                    self.faults.check(Stage.DRAFT, r.rid)
                one = {key: [v[i]] for key, v in extra.items()}
                drafts.extend(self.source.propose([r], [k], **one))
            except Exception as e:
                fail_request(r, Stage.DRAFT, e)
                drafts.append(None)
        return drafts

    def _trim(self, r, draft: PlannedDraft) -> Optional[PlannedDraft]:
        if r.grammar is None:
            return draft
        try:
            return self._trim_to_grammar(r, draft)
        except Exception as e:
            fail_request(r, Stage.GRAMMAR_MASK, e)
            return None

    def _trim_to_grammar(self, r, draft: PlannedDraft) -> Optional[PlannedDraft]:
        """Keep the drafts the grammar allows; masks of positions 0..kept (rows)."""
        if self.faults is not None:
            self.faults.check(Stage.GRAMMAR_MASK, r.rid)
        nf = draft.num_forced
        if draft.parents is not None:
            kept, parents, mask = grammar_tree_draft(r.grammar, draft.tokens, draft.parents, self.vocab_size)
            nf = min(nf, next((j for j, p in enumerate(parents) if p != j - 1), len(parents)))
            return PlannedDraft(kept, mask, parents=parents, num_forced=nf) if kept else None
        kept, mask = grammar_draft(r.grammar, draft.tokens, self.vocab_size)
        if not kept:
            return None
        return PlannedDraft(kept, mask, num_forced=min(nf, len(kept)))

    # -- after the verify step ------------------------------------------------------------------
    def after_verify(self, r, proposed: int, accepted: int, appended: List[int],
                     reach: Optional[int] = None, moved: bool = False) -> None:
        """`proposed` drafts (tree nodes; forced text not counted), `accepted` of them; `reach`:
        the most one verify could accept (a tree's depth; default `proposed`), what the budget
        counts as proposed; `moved`: a tree's accepted path needed its KV moved."""
        self.stats["spec_num_verify"] += 1
        self.stats["spec_num_tree_moves"] += moved
        self.stats["spec_num_draft_tokens"] += proposed
        self.stats["spec_num_accepted_tokens"] += accepted
        if r.spec is not None:
            r.spec.verify_ct += 1
            r.spec.draft_tokens += proposed
            r.spec.accepted_tokens += accepted
        b = self.budgets.get(r.rid)
        reach = max(1, proposed if reach is None else reach)
        self.accept.update(reach, accepted)
        if b is not None:
            b.update(reach, accepted, self.spec.max_drafts)
            b.shadow = None  # this verify measured it (a shadow would count the same tokens again)
        self.source.on_verified(r, appended, accepted)

    def release(self, r) -> None:
        self.budgets.pop(r.rid, None)
        try:
            self.source.release(r)
        except Exception:  # the request is done either way; the source's state may leak
            logger.exception("draft source failed to release request %s", r.rid)

    def internal_state(self) -> dict:
        s = self.stats
        n = s["spec_num_verify"]
        return {"avg_spec_accept_length": (s["spec_num_accepted_tokens"] + n) / n if n else 0.0,
                "spec_accept_rate": (s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"]
                                     if s["spec_num_draft_tokens"] else 0.0)}


def _planned(d) -> PlannedDraft:
    """A source's Draft as a PlannedDraft (a tree made well-formed: tree.well_formed)."""
    if d.parents is None:
        return PlannedDraft(list(d.tokens))
    tokens, parents = well_formed(list(d.tokens), list(d.parents))
    return PlannedDraft(tokens, parents=parents)


def build_speculator(args, runner, jump_forward: bool, stats: dict, faults=None) -> Optional[Speculator]:
    """The scheduler's Speculator for `args`, or None when speculation is off."""
    from lmprog_runtime.speculative.config import resolve_speculative
    spec = resolve_speculative(args)
    if spec is None:
        return None
    from lmprog_runtime.speculative.base import create_draft_source
    source = create_draft_source(spec, runner, args)
    on_gpu = getattr(runner.device, "type", "cpu") == "cuda"
    return Speculator(spec, source, runner.model_config.vocab_size, jump_forward, stats, faults,
                      GPU_STEP_DRAFT_TOKENS if on_gpu else CPU_STEP_DRAFT_TOKENS,
                      cost_rule=not args.speculative_disable_cost_rule)
