"""The decode loop over rows: propose -> score -> verify -> rollback -> emit.

ONE loop, `Engine.step`, serves every caller: `generate` and `stream` are a batch of one,
`generate_batch` a batch, the server a batch whose rows come and go between steps. Plain decoding
is the same loop with k = 0: the target scores [last] alone and verification degenerates to
sampling (or argmax) from p, so the comparison between the two measures speculation and nothing else.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import numpy as np

from .config import GenerationConfig
from .controller import Controller, Outcome
from .costs import split_forward, step_depth
from .drafters.base import Draft, Drafter, DraftModel
from .errors import SpecdecError
from .models.base import RowModel, SavedRow, tree_depths
from .sampling import (
    DraftTree,
    TokenLogprob,
    masked,
    token_logprob,
    verify_draft,
)
from .stats import GenerationStats
from .text import Detokenizer

# Prompt tokens joining rows prefill per step while other rows are decoding, where the engine has
# no cost curve to size the step by (prefill_stall): a long prompt is cut into chunks so that the
# running rows wait one chunk, not the whole prompt (alone, a row prefills at once).
# why: it bounds the running rows' stall, which depends on the machine;
# history: docs/results/provenance.md#prefill_chunk
PREFILL_CHUNK = 256
# A step that carries joining rows' prompt chunks along with the decoding rows' tokens may cost up
# to this many times the decoding rows' own plain step (from the cost curve): the chunks get the
# widest budget that keeps it so, at least one token a step.
# why: a decoding row's inter-token gap stays within this factor of its plain step while others
# join, on any curve (on a GPU's flat curve hundreds of prompt tokens ride along, on this CPU's steep
# one a few); history: docs/results/provenance.md#prefill_stall
PREFILL_STALL = 1.5
# A joining row's chunk rides along only where its prompt tokens cost at most this many times, per
# token, what they cost read alone in one forward (on the cost curve); else the row waits for the
# decoding rows to end (then it reads its prompt at once), at most as many steps as reading it
# chunk by chunk would take.
# why: on a steep curve (this CPU's) the few tokens that fit a step cost twice what they cost read
# in bulk, and every decoding row's step is slower the whole time; on a flat one (a GPU's) chunks
# ride almost free and this never holds a joiner back; history: docs/results/provenance.md#prefill_waste
PREFILL_WASTE = 1.5
# A finished row's cache is kept (Engine(prefix_cache=True), where the target keeps idle rows for
# free) and a new prompt takes the kept row that already holds the longest start of it, when that
# start is at least this many tokens; else the kept row with the lowest id (which still reuses what
# it shares, a chat template's opening say). New rows only once no row is kept.
# why: llama.cpp's per-row streams pass over the weights once per run of consecutive row ids, so
# a row taken out of order can cost every step of its request a second pass (rows 0, 1, 3: 96 ms
# a step, rows 0-1 64 and 0-3 110, this CPU); only a long shared start pays for that;
# history: docs/results/provenance.md#prefix_min
PREFIX_MIN = 256
# Where a kept row is taken by a prompt that does not share all it holds, its cache is first
# copied to host memory (Engine's host_cache, llama-server's --cache-ram, in MiB there as in
# `specdec serve`), and a later prompt that starts as a copy does reads it back instead of
# prefilling: a copy costs ~28 KiB a token for the 1.5B, a memcpy, where prefilling costs a forward.
# why: llama-server's default; with more conversations than rows, a row's cache is otherwise lost to
# the next request and the conversation's next turn reads its whole history again (second turns'
# TTFT 0.2-0.4 s against 1.1-4.8 s, three conversations on one row); history: docs/results/provenance.md#host_cache_mib
HOST_CACHE_MIB = 8192


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]  # generated tokens (the stop string's tokens included)
    prompt_tokens: list[int]
    stats: GenerationStats = field(default_factory=GenerationStats)
    logprobs: list[TokenLogprob] | None = None  # one per generated token, when the config asked

    def to_dict(self) -> dict:
        out = {
            "text": self.text,
            "tokens": self.tokens,
            "prompt_tokens": len(self.prompt_tokens),
            "stats": self.stats.to_dict(),
        }
        if self.logprobs is not None:
            out["logprobs"] = [{"token": e.token, "logprob": e.logprob, "top": e.top} for e in self.logprobs]
        return out


class Request:
    """One prompt in the engine: the caller's handle. `read()` takes the text produced since the
    last call (whole UTF-8 characters, held back while it could still become a stop string);
    `done` and `result` say when and how it ended."""

    def __init__(self, id: int, prompt_tokens: list[int], config: GenerationConfig, tokenizer):
        self.id = id
        self.prompt_tokens = prompt_tokens
        self.config = config
        self.params = config.sampling
        self.rng = np.random.default_rng(config.seed)  # this row's own stream: batch-independent
        # config.reproducible: the seed that keys every position's noise (a fresh one if unseeded)
        self.noise_seed = None
        if config.reproducible:
            self.noise_seed = config.seed if config.seed is not None else int(np.random.SeedSequence().entropy % 2**64)
        self.stats = GenerationStats(prompt_tokens=len(prompt_tokens))
        self.text = Detokenizer(tokenizer, config.stop)
        self.context = list(prompt_tokens)
        self.row: int | None = None  # the target's row, once admitted
        self.policy = None  # how its row is speculated, where the controller decides per request (Engine.add)
        self.constraint = None  # its grammar's state (grammar.Constraint), where config.constraint is set
        self.prefilled = 0  # prompt tokens in the row's cache
        self.result: GenerationResult | None = None
        self.logprobs: list[TokenLogprob] | None = [] if config.logprobs is not None else None
        self._pieces: list[str] = []
        self._logprobs_read = 0
        self._t_decode = 0.0
        self._waited = 0  # steps it joined, but its chunk would have cost too much (Engine._chunks)

    @property
    def done(self) -> bool:
        return self.result is not None

    def read(self) -> str:
        pieces, self._pieces = self._pieces, []
        return "".join(pieces)

    def read_logprobs(self) -> list[TokenLogprob]:
        """The generated tokens' log-probabilities since the last call (none unless asked for)."""
        if self.logprobs is None:
            return []
        new, self._logprobs_read = self.logprobs[self._logprobs_read :], len(self.logprobs)
        return new


class Engine:
    """Rows join (`add`), advance together (`step`) and leave when done or cancelled (`cancel`).

    Each step: 1-2. the controller chooses every live row's drafter and k and drafts; 3. ONE
    target forward over every row's [last, *draft] and the joining rows' next prompt chunks;
    4. each row is verified with its own random stream; 5. every row is rolled back to what it
    kept and the drafters are told; 6. each row emits (stop rules, text), finished rows leave,
    queued rows take free rows. While nobody decodes, joining rows prefill whole prompts at once.
    With `prefix_cache` a finished row keeps its cache (where the target keeps idle rows for
    free), and a queued prompt that starts as a kept row's cache does takes that row and reads
    only the rest (PREFIX_MIN). With `host_cache` bytes as well (None: no limit; where the target
    can copy a row out, save_row), a kept row's cache is copied to host memory before a prompt
    that does not share it all takes the row (where the target keeps no idle rows, every finished
    row's cache is, as the row goes), and a prompt that starts as a copy does reads it back into
    its row instead (HOST_CACHE_MIB).

    `costs` (a cost curve, cost(width, depth) -> seconds; the cost-aware controller's) sizes the
    prompt chunks a step carries: the widest that keeps the step within `prefill_stall` times the
    decoding rows' plain step. Without one, `prefill_chunk` tokens a step."""

    def __init__(
        self,
        target: RowModel,
        controller: Controller,
        drafters: Sequence[Drafter] = (),
        max_rows: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        clock: Callable[[], float] = time.perf_counter,
        costs: Callable[[int, float | None], float] | None = None,
        prefill_stall: float = PREFILL_STALL,
        prefill_waste: float = PREFILL_WASTE,
        prefix_cache: bool = False,
        host_cache: int | None = 0,
    ):
        if prefill_stall < 1.0:
            raise SpecdecError(f"prefill_stall must be at least 1 (times a plain step), got {prefill_stall}")
        if prefill_waste < 1.0:
            raise SpecdecError(f"prefill_waste must be at least 1 (times a token read alone), got {prefill_waste}")
        self.target, self.controller, self.drafters = target, controller, list(drafters)
        self.prefill_chunk = prefill_chunk
        self.costs, self.prefill_stall, self.prefill_waste = costs, prefill_stall, prefill_waste
        # what the engine times its forwards with (the stats, and the costs the controller
        # learns): a test gives a virtual clock so that decisions never depend on machine load
        self.clock = clock
        # rows at once: at most max_rows, the target's, and each draft model's (it mirrors them)
        self.max_rows = min(
            [max_rows or target.max_rows, target.max_rows]
            + [d.model.max_rows for d in self.drafters if isinstance(d, DraftModel)]
        )
        self.queue: list[Request] = []  # waiting for a row
        self.rows: dict[int, Request] = {}  # target row -> request (prefilling or live)
        # prefix_cache: finished rows stay in the target with their caches, for prompts that start
        # the same way (a conversation's next turn, a repeated prompt, a shared system prompt);
        # only where the target keeps idle rows at no cost to the others (keeps_idle_rows)
        self.prefix_cache = prefix_cache and target.keeps_idle_rows
        if host_cache is not None and host_cache < 0:
            raise SpecdecError(f"host_cache is a number of bytes (None: no limit), got {host_cache}")
        # (a target that keeps no idle rows, one pool of cells, has its finished rows copied out
        # instead: a conversation's next turn still reads only its new message)
        copies = prefix_cache and host_cache != 0 and target.saves_rows
        self.host = HostCache(host_cache) if copies else None
        self.idle: dict[int, list[int]] = {}  # kept row -> the tokens its cache holds
        self._unknown: set[int] = set()  # rows in use whose caches a failed step left unknown (drop_idle)
        self._ids = itertools.count()
        self._grammars = None  # grammar.Grammars for the target, made at the first constrained request
        self._grammar_lookup = None  # prompt lookup past a grammar's forced tokens (_lookup)

    # -- the caller's verbs --------------------------------------------------------------------

    def add(self, prompt_tokens: list[int], config: GenerationConfig, policy=None) -> Request:
        """Queue a prompt. `policy`: how its row is speculated (a spec.DraftSpec for a controller
        that decides per request, the server's RoutingController; None: the controller's own way).
        The request carries it, and the controller is told it with the row (Controller.begin)."""
        request = Request(next(self._ids), prompt_tokens, config, self.target.tokenizer)
        request.policy = policy
        if config.constraint is not None:
            request.constraint = self.grammars.constraint(config.constraint)
        self.queue.append(request)
        return request

    @property
    def grammars(self):
        """The target's compiled grammars (grammar.Grammars): a caller that compiles a request's
        grammar ahead (the server, off its engine thread) warms the cache add() reads."""
        if self._grammars is None:
            from .grammar import Grammars

            self._grammars = Grammars(self.target)
        return self._grammars

    def cancel(self, request: Request) -> None:
        """Stop a request now; its row and caches are freed at once."""
        if request.done:
            return
        if request in self.queue:
            self.queue.remove(request)
        request.stats.finish_reason = "cancelled"
        self._finish([request])

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.rows)

    @property
    def reads_prompts_only(self) -> bool:
        """The next step only reads prompts (requests are in, no row decodes yet) and a row is free
        for one more: a caller that can wait a moment for other requests (the server's gathering
        window) gets theirs read in the same forward, instead of behind it."""
        return self.busy and not self._decoding() and len(self.rows) + len(self.queue) < self.max_rows

    def _decoding(self) -> bool:
        """Whether a row has emitted a token: a row whose whole prompt was found in a kept cache
        (prefix_cache) is not decoding yet, so it waits for its wave's prompts, as a request that
        arrived with them and read its own would, and the wave decodes together."""
        return any(r.stats.generated_tokens for r in self.rows.values())

    def run(self, requests: Sequence[Request]) -> None:
        """Step until these requests are done."""
        while not all(r.done for r in requests):
            self.step()

    # -- the loop ------------------------------------------------------------------------------

    def step(self) -> None:
        """One step over every live row: draft, score, verify, roll back, emit (the module docstring)."""
        rows, joining = self._live()
        if not rows:
            return
        contexts = {row: r.context for row, r in rows.items()}
        t = self.clock()
        plan = self._draft(rows, contexts)
        drafts = {row: (d.tokens if d is not None else []) for row, (_, d) in plan.items()}
        plan, own = self._constrain(rows, plan, drafts)
        t_draft = self.clock() - t
        trees = {row: DraftTree(tuple(d.tokens), tuple(d.parents)) for row, (_, d) in plan.items() if d and d.parents}
        forward = self._score(contexts, drafts, trees, joining)
        self._mask(rows, drafts, forward.logits)
        verdicts = self._verify(rows, plan, drafts, trees, forward.logits)
        t = self.clock()
        self._roll_back(contexts, verdicts, trees)
        forward.seconds += self.clock() - t
        t = self.clock()
        for drafter in self.drafters:  # each drafter hears about the rows it drafted for (its own tokens)
            told = {row: min(len(verdicts[row][0]), own[row]) for row, (d, _) in plan.items() if d is drafter}
            if told:
                drafter.accept(told)
        t_draft += self.clock() - t
        outcomes = self._emit_rows(rows, plan, drafts, trees, verdicts, forward, t_draft, own)
        self.controller.observe(outcomes, forward.passes(trees), forward.seconds, forward.depth)
        for row, r in rows.items():
            r.stats.predicted_speedup, r.stats.measured_speedup = self.controller.speedups(
                row, r.stats.tokens_per_second
            )
        finished = [r for r in rows.values() if r.stats.finish_reason]
        if finished:
            self._finish(finished)

    def _live(self) -> tuple[dict[int, Request], list[Request]]:
        """The rows that decode this step (queued requests admitted, whole prompts prefilled where
        nobody decodes, rows whose context is full finished), and the rows still joining (their
        prompt chunks ride along)."""
        self._admit()
        joining = [r for r in self.rows.values() if r.prefilled < len(r.prompt_tokens) - 1]
        if joining and not self._decoding():  # nobody decodes: whole prompts, then a step
            self._prefill(joining)
        live = [r for r in self.rows.values() if r.prefilled == len(r.prompt_tokens) - 1]
        full = [r for r in live if self.target.n_ctx - len(r.context) - 1 < 0]  # not even [last] fits
        for request in full:
            request.stats.finish_reason = "context"
        if full:
            self._finish(full)
        joining = [r for r in self.rows.values() if r.prefilled < len(r.prompt_tokens) - 1]
        return {r.row: r for r in live if not r.done}, joining

    def _draft(self, rows: Mapping[int, Request], contexts) -> dict[int, tuple[Drafter | None, Draft | None]]:
        """The controller picks each row's drafter and k (0 = a plain step) and drafts: a draft never
        overflows the context, nor outruns the tokens the row still wants (k + 1 emitted); each
        row's room for a tree is fixed before anything is drawn (_tree_room), so that no draw
        decides between a tree's rule and a chain's; a draft ends at its first end-of-generation
        token (nothing after it is ever emitted) and before any token outside the vocabulary."""
        target = self.target
        caps = {row: self._room(r) for row, r in rows.items()}
        leaves = self._tree_room(rows)
        plan = self.controller.draft(contexts, caps, leaves)
        return {
            row: (d, self._fitted(d, draft.upto(target.tokenizer.eog_ids, target.vocab_size), leaves.get(row)))
            if draft is not None
            else (d, None)
            for row, (d, draft) in plan.items()
        }

    def _score(self, contexts, drafts, trees, joining) -> "_Forward":
        """ONE target forward: row r scores [last, *draft], k + 1 logits rows each; the joining
        rows' prompt chunks ride along (no logits). A tree row scores [last, *nodes] with its nodes
        under last (a second call where chains or prompts share the step). The chains and chunks go
        in one forward, or in a few where the cost curve prices that less."""
        target = self.target
        inputs = {row: [contexts[row][-1], *drafts[row]] for row in contexts if row not in trees}
        chunks = self._chunks(joining, inputs, {row: len(c) for row, c in contexts.items()}) if joining else {}
        fed = {**inputs, **chunks}
        tree_inputs = {
            row: ([contexts[row][-1], *tree.tokens], [-1, *(p + 1 for p in tree.parents)])
            for row, tree in trees.items()
        }
        # tokens the step feeds each row (chains, prompt chunks, trees): its depth, and its passes
        counts = {row: len(tokens) for row, tokens in {**fed, **{r: t for r, (t, _) in tree_inputs.items()}}.items()}
        lengths = {row: len(context) for row, context in contexts.items()}
        depth = step_depth(counts, {**lengths, **{row: self.rows[row].prefilled for row in chunks}})  # before they grow
        groups = self._split({row: len(tokens) for row, tokens in fed.items()}, depth) if fed else []
        t = self.clock()
        logits = {}
        for group in groups:
            wanted = {row: len(inputs[row]) for row in group if row in inputs}
            logits.update(target.forward_rows({row: fed[row] for row in group}, wanted))
        if tree_inputs:
            logits.update(target.forward_tree_rows(tree_inputs))
        seconds = self.clock() - t
        self._prefilled(chunks, seconds)
        return _Forward(target, logits, groups, counts, depth, seconds)

    def _verify(self, rows, plan, drafts, trees, logits) -> dict[int, tuple[list[int], int]]:
        """Each row verified with its own random stream, by the rule sampling.verify_draft picks
        from its params and its draft's shape: the draft tokens kept, and the token after them."""
        verdicts = {}
        for row, r in rows.items():
            draft = plan[row][1]
            at = (r.noise_seed, r.stats.generated_tokens) if r.config.reproducible else None
            verdicts[row] = verify_draft(
                logits[row],
                drafts[row],
                trees.get(row),
                draft.q if draft is not None else None,
                r.params,
                r.rng,
                r.config.verification,
                at,
            )
        return verdicts

    def _roll_back(self, contexts, verdicts, trees) -> None:
        """Every row's cache cut back to what it kept (a tree: node 0 is the row's last token, node
        i + 1 the tree's node i)."""
        self.target.rollback_rows(
            {row: len(contexts[row]) + len(verdicts[row][0]) for row in contexts if row not in trees}
        )
        if trees:
            self.target.keep_path_rows({row: [0, *(n + 1 for n in verdicts[row][0])] for row in trees})

    def _emit_rows(self, rows, plan, drafts, trees, verdicts, forward: "_Forward", t_draft: float, own) -> dict:
        """Each row's kept tokens and the one after them emitted (up to end-of-generation, the token
        budget, a stop string), its stats and logprobs: the controller's outcomes (of the drafter's
        own tokens: a grammar's forced tokens after them are not its)."""
        target, outcomes, now = self.target, {}, self.clock()
        for row, r in rows.items():
            drafter, draft = plan[row]
            path, next_token = verdicts[row]
            s = r.stats
            s.draft_seconds += t_draft
            s.target_seconds += forward.seconds
            deepest = int(tree_depths(trees[row].parents).max(initial=-1)) + 1 if row in trees else None
            kind = drafter.kind if drafter else ("grammar" if drafts[row] else "plain")
            s.record_step(len(drafts[row]), len(path), kind, deepest)
            if own[row] < len(drafts[row]):  # the grammar's forced tokens: drafted and kept
                s.forced_drafted += len(drafts[row]) - own[row]
                s.forced_kept += max(0, len(path) - own[row])
            emitted, s.finish_reason = _emit(
                [*(drafts[row][i] for i in path), next_token],
                target.tokenizer.eog_ids,
                r.config.max_new_tokens - s.generated_tokens,
            )
            r.context += emitted
            s.generated_tokens += len(emitted)
            if r.constraint is not None:
                r.constraint.consume(emitted)
            if r.logprobs is not None:  # emitted token i is what logits row i scored (a tree: its path's)
                scored = [0, *(i + 1 for i in path)]
                r.logprobs += [
                    token_logprob(forward.logits[row][j], t, r.config.logprobs) for j, t in zip(scored, emitted)
                ]
            s.decode_seconds = now - r._t_decode
            if draft is not None and own[row] < len(draft.tokens):
                draft = draft._first(own[row])
            outcomes[row] = Outcome(drafter, draft, min(len(path), own[row]), emitted)
            if r.text.add(emitted):
                s.finish_reason = "stop"
            piece = r.text.ready()
            if piece:
                r._pieces.append(piece)
        return outcomes

    def _tree_room(self, rows: Mapping[int, Request]) -> dict[int, int]:
        """The most leaves each row's draft may have this step, fixed before anything is drafted
        (0: a chain): a tree where the target scores trees and the row may verify one (_tree_ok),
        the target's room for leaves (llama.cpp lends a sequence id per leaf: tree_leaves) shared
        equally among those rows; no entry where the room has no limit. Why before: a sampled
        tree kept where it fits and swapped for its first branch where it does not verifies the
        draft by two rules (node by node, and the chain's block rule), chosen by a count that
        depends on the draws; each rule is exact alone, the mixture is not (README, "Trees of drafts")."""
        room = self.target.tree_leaves
        trees = [row for row, r in rows.items() if self._tree_ok(r)]
        share = None if room is None else room // max(1, len(trees))
        out = {row: 0 for row in rows if row not in trees}
        if share is not None:
            out.update({row: share if share >= 2 else 0 for row in trees})
        return out

    def _fitted(self, drafter: Drafter | None, draft: Draft, most: int | None) -> Draft:
        """The draft within its row's room (_tree_room). A tree of fixed candidates (no q: prompt
        lookup's, the suffix cache's, a greedy draft's) may be swapped for its first branch here:
        its rules are exact given the draft itself, whatever chose it. A sampled tree cannot: its
        drafter chose its shape within the room before drawing (drafters.base.fit_tree), and one
        that did not is a bug that would bias the output, so it stops the step."""
        if draft.parents is None or most is None or (most >= 2 and draft.leaves() <= most):
            return draft
        if draft.q is None:
            return draft.first_branch()
        name = drafter.name if drafter is not None else "a drafter"
        raise SpecdecError(
            f"{name} drafted a sampled tree of {draft.leaves()} leaves where the step reserved {most} "
            "(0: a chain); a tree cut after drawing would not sample the target's distribution"
        )

    def _room(self, request: Request) -> int:
        """The most draft tokens a row may take this step: the context's room and the tokens it
        still wants, the one after the draft counted."""
        left = request.config.max_new_tokens - request.stats.generated_tokens
        return max(0, min(self.target.n_ctx - len(request.context) - 1, left - 1))

    def _constrain(self, rows, plan, drafts) -> tuple[dict, dict[int, int]]:
        """Each constrained row's draft made the grammar's (Constraint.extend): a free or greedy
        draft is cut at its first token the grammar refuses and followed by the tokens the grammar
        forces there, all a function of the context alone, so every rule stays exact given the
        draft. A sampled draft with a q is left whole: cutting it where a draw was refused would
        choose its rule by the draw; a refused token has probability 0 under the masked target,
        and every rule rejects it. An engine without drafters (plain decoding, the baseline) drafts
        nothing, forced tokens included. Also: each drafter's own tokens in its row's draft."""
        own = {row: len(drafts[row]) for row in rows}
        for row, r in rows.items():
            if r.constraint is None or not self.drafters:
                continue
            drafter, draft = plan[row]
            if draft is not None and draft.q is not None and not r.params.greedy:
                continue
            cap = self._room(r)
            mine = drafts[row]
            free = drafter is not None and draft is not None and draft.q is None and mine
            lookup = self._lookup(r.context) if free else None  # a free drafter's guesses go on past forced tokens
            tokens, own[row] = r.constraint.extend(mine, cap, len(mine), lookup)
            if tokens != mine:
                new = Draft(tokens, evidence=draft.evidence if draft is not None else {})
                new = new.upto(self.target.tokenizer.eog_ids, self.target.vocab_size)
                own[row] = min(own[row], len(new.tokens))
                plan[row] = (drafter, new if new.tokens or draft is not None else None)
                drafts[row] = new.tokens
        return plan, own

    def _lookup(self, context: Sequence[int]):
        """Prompt lookup's continuation of `context` and a draft so far (Constraint.extend's
        lookup): where the grammar has forced tokens into a free draft, the guesses go on after
        them, as the drafter's own would have."""
        from .drafters.ngram import NgramDrafter, _Index

        if self._grammar_lookup is None:
            self._grammar_lookup = NgramDrafter(n_min=1)

        def lookup(draft: Sequence[int], k: int) -> list[int]:
            return self._grammar_lookup.propose_one(_Index(), [*context, *draft], k).tokens

        return lookup

    def _mask(self, rows, drafts, logits) -> None:
        """Each constrained row's logits masked to what its grammar allows at each position
        (Constraint.masks), in place: verification, the bonus token and logprobs all read p
        under the grammar."""
        for row, r in rows.items():
            if r.constraint is not None:
                logits[row] = masked(logits[row], r.constraint.masks(drafts[row]))

    def _tree_ok(self, request: Request) -> bool:
        """Whether this row may verify a tree: the target scores trees (models' scores_trees), the
        row is not sampled by position (reproducible), whose rule is a chain's, and its output is
        not constrained (a grammar's masks follow one chain)."""
        sampled_by_position = request.config.reproducible and not request.params.greedy
        return self.target.scores_trees and not sampled_by_position and request.constraint is None

    def drop_idle(self) -> None:
        """Forget the kept rows (prefix_cache), and keep or copy none of the rows in use when their
        requests end: a failed step may have left their caches unknown."""
        self._unknown.update(self.rows)
        if self.idle:
            self.target.drop_rows(list(self.idle))
            self.idle.clear()

    def _admit(self) -> None:
        """Queued requests take free rows (their prompts are prefilled by the steps that follow):
        a kept row whose cache already holds the start of the prompt, else a new one."""
        n = min(len(self.queue), self.max_rows - len(self.rows))
        if n > 0:
            admitted, self.queue = self.queue[:n], self.queue[n:]
            # what each kept row holds of each prompt (the last prompt token opens decoding: it is
            # never cached); the kept rows go first to the requests that share the most with one
            # (one that came first would otherwise take the lowest id from under a better match);
            # new rows once none is kept, in one call (adding rows to a batched cache copies it)
            # (host_cache: or a copy in host memory, read back into the row the request takes)
            shares = {
                r.id: {row: _shared_start(t, r.prompt_tokens[:-1]) for row, t in self.idle.items()} for r in admitted
            }
            copied = {
                r.id: (self.host.longest(r.prompt_tokens[:-1]) or (0, 0))[1] if self.host else 0 for r in admitted
            }
            rows, read_back = {}, {}
            for request in sorted(admitted, key=lambda r: -max([*shares[r.id].values(), copied[r.id]])):
                share = shares[request.id]
                row = self._kept_choice(share)
                # asked again: a row taken by a request before this one may have been copied out
                copy = self.host.longest(request.prompt_tokens[:-1]) if self.host else None
                if copy is not None and copy[1] > (share[row] if row is not None else 0):
                    key, n = copy
                    read_back[request.id] = (key, self.host.take(key), n)  # held here, whatever the cache drops
                    share = dict.fromkeys(share, 0)  # the row's cache is replaced: the lowest kept id
                    row = self._kept_choice(share)
                rows[request.id] = self._kept_row(request, row, share[row]) if row is not None else None
            kept = [rows[r.id] for r in admitted]
            fresh = iter(self.target.add_rows(kept.count(None)) if None in kept else ())
            for request, row in zip(admitted, kept):
                row = next(fresh) if row is None else row
                if request.id in read_back:
                    self._read_back(request, row, *read_back[request.id])
                request.row = row
                request._t_decode = self.clock()
                self.rows[row] = request
                for drafter in self.drafters:
                    drafter.begin(row, request.prompt_tokens, request.params, request.rng)
                self.controller.begin(row, request.prompt_tokens, request.policy)

    def _kept_choice(self, shares: Mapping[int, int]) -> int | None:
        """The kept row a request takes (`shares`: the prompt tokens each kept row holds), or None
        where none is kept: the one holding the most where that is PREFIX_MIN tokens or more, else
        the lowest id (the model lends the lowest ids first, so the rows in use stay as close to
        one run of ids as without the cache)."""
        shared = {row: n for row, n in shares.items() if row in self.idle}
        return min(shared, key=lambda r: (-shared[r] if shared[r] >= PREFIX_MIN else 0, r)) if shared else None

    def _kept_row(self, request: Request, row: int, shared: int) -> int:
        """The request takes kept `row`, its cache cut to the `shared` tokens (the prefill resumes
        there); with host_cache, what the cut loses is copied out first."""
        held = self.idle.pop(row)
        if shared < len(held):
            self._copy_out(row, held)
        self.target.rollback_rows({row: shared})
        request.prefilled = request.stats.cached_tokens = shared
        return row

    def _copy_out(self, row: int, held: list[int]) -> None:
        """With host_cache, the row's cache (holding `held`) copied to host memory, unless a copy
        holds those tokens already. A copy the model cannot make (or memory for it) is skipped:
        a later prompt reads those tokens again."""
        if self.host is not None and held and not self.host.holds(held):
            try:
                self.host.put(held, self.target.save_row(row))
            except (SpecdecError, MemoryError):
                pass

    def _read_back(self, request: Request, row: int, key: int, saved: SavedRow, shared: int) -> None:
        """The host copy `saved` (the cache's `key`) read into the request's row, cut to the
        `shared` tokens its prompt starts with (the prefill resumes there). A copy the model cannot
        place is forgotten and the row, left empty, reads the whole prompt."""
        try:
            self.target.load_row(row, saved)
        except SpecdecError:
            if key in self.host.entries:
                self.host.forget(key)
            request.prefilled = request.stats.cached_tokens = 0
            return
        self.target.rollback_rows({row: shared})
        request.prefilled = request.stats.cached_tokens = shared

    def _chunks(
        self, joining: Sequence[Request], inputs: Mapping[int, Sequence[int]], depths: Mapping[int, int]
    ) -> dict[int, list[int]]:
        """The joining rows' next prompt chunks for a step whose decoding rows feed `inputs` (at
        cache depths `depths`), in the order the rows joined: the most prompt tokens that keep the
        step within prefill_stall times the decoding rows' plain step (the cost curve's estimate;
        the first joiner gets at least one token), or prefill_chunk tokens without a curve. A chunk
        that would cost more than prefill_waste times what its tokens cost read alone waits
        (PREFILL_WASTE), unless the row has waited as many steps as such chunks would take."""
        fed = {row: len(tokens) for row, tokens in inputs.items()}
        depths = dict(depths)
        if self.costs is not None:
            limit = self.prefill_stall * self._seconds({row: 1 for row in inputs}, depths)
        budget = self.prefill_chunk
        chunks: dict[int, list[int]] = {}
        for r in joining:
            wanted = len(r.prompt_tokens) - 1 - r.prefilled  # the last prompt token opens decoding
            depths[r.row] = r.prefilled
            if self.costs is None:
                n = min(wanted, budget)
            else:  # the most tokens that fit (a step's cost only grows with its width)
                lo, hi = 0, wanted
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    lo, hi = (mid, hi) if self._seconds({**fed, r.row: mid}, depths) <= limit else (lo, mid - 1)
                n = lo if lo or chunks else min(1, wanted)
                if n > 0 and r._waited * n < wanted and self._wasteful(fed, r, n, wanted, depths):
                    r._waited += 1
                    continue
            if n <= 0:
                break
            chunks[r.row] = r.prompt_tokens[r.prefilled : r.prefilled + n]
            fed[r.row] = n
            budget -= n
        return chunks

    def _wasteful(self, fed: Mapping[int, int], r: Request, n: int, wanted: int, depths: Mapping[int, int]) -> bool:
        """Whether n of row r's prompt tokens cost more, per token, riding in a step that feeds `fed`
        than prefill_waste times what its remaining `wanted` tokens cost read alone."""
        riding = (self._seconds({**fed, r.row: n}, depths) - self._seconds(fed, depths)) / n
        alone = self._seconds({r.row: wanted}, depths) / wanted
        return riding > self.prefill_waste * alone

    def _seconds(self, fed: Mapping[int, int], depths: Mapping[int, int]) -> float:
        """The cost curve's estimate of a step's forwards feeding fed[row] tokens to each row (each
        of their passes over the weights priced at the step's depth; _split's forwards)."""
        return split_forward(fed, self.target.passes, self.costs, step_depth(fed, depths))[1]

    def _split(self, fed: Mapping[int, int], depth: float) -> list[dict[int, int]]:
        """The forwards a step feeds fed[row] tokens in: those costs.split_forward finds cheapest on
        the cost curve (the controller prices its steps alike); one without a curve."""
        return split_forward(fed, self.target.passes, self.costs, depth)[0] if self.costs is not None else [dict(fed)]

    def _prefill(self, joining: Sequence[Request]) -> None:
        """Nobody decodes: the joining rows prefill their whole prompts in one forward."""
        chunks = {r.row: r.prompt_tokens[r.prefilled : len(r.prompt_tokens) - 1] for r in joining}
        t = self.clock()
        self.target.forward_rows(chunks)
        self._prefilled(chunks, self.clock() - t)

    def _prefilled(self, chunks: Mapping[int, Sequence[int]], seconds: float) -> None:
        """These rows' chunks are in their caches, after a forward of `seconds`."""
        now = self.clock()
        for row, chunk in chunks.items():
            r = self.rows[row]
            r.prefilled += len(chunk)
            r.stats.prefill_seconds += seconds
            r.stats.target_seconds += seconds
            r._t_decode = now  # its decoding starts after its prompt

    def _finish(self, requests: Sequence[Request]) -> None:
        """The requests leave: their rows are freed (in one call: dropping rows from a batched
        cache copies it), their text completed, their results set."""
        rows = [r.row for r in requests if r.row is not None]
        if rows:
            # what each request fed, its context but the last token, where its row's cache is known
            # and is kept or copied out
            keeps = self.prefix_cache or self.host is not None
            held = {r.row: _held(r) for r in requests if keeps and r.row is not None and r.row not in self._unknown}
            self._unknown.difference_update(rows)
            if held:
                self.target.rollback_rows({row: len(tokens) for row, tokens in held.items()})
            if self.prefix_cache:  # kept
                self.idle.update(held)
                unknown = [row for row in rows if row not in held]
                if unknown:
                    self.target.drop_rows(unknown)
            else:
                for row, tokens in held.items():  # the row goes; its cache to host memory first
                    self._copy_out(row, tokens)
                self.target.drop_rows(rows)
            for drafter in self.drafters:
                drafter.end(rows)
            for row in rows:
                self.controller.end(row)
                self.rows.pop(row)
        for request in requests:
            request.row = None
            piece = request.text.finish()
            if piece:
                request._pieces.append(piece)
            request.stats.generated_tokens = len(request.text.tokens)
            request.result = GenerationResult(
                text=request.text.text,
                tokens=request.text.tokens,
                prompt_tokens=request.prompt_tokens,
                stats=request.stats,
                logprobs=request.logprobs[: len(request.text.tokens)] if request.logprobs is not None else None,
            )


@dataclass
class _Forward:
    """What a step's target forwards gave: each row's logits, the groups of rows the chains and
    chunks went in, the tokens fed each row, the step's depth and the seconds they took."""

    target: RowModel
    logits: dict
    groups: list
    counts: dict[int, int]
    depth: float
    seconds: float

    def passes(self, trees: Mapping) -> list[int]:
        """The widths of the passes over the weights: each forward's, and a tree call's by its own rows."""
        if len(self.groups) <= 1:
            return self.target.passes(self.counts)
        passes = [w for group in self.groups for w in self.target.passes(group)]
        if trees:
            passes += self.target.passes({row: self.counts[row] for row in trees})
        return passes


def _held(request: Request) -> list[int]:
    """What a request's row holds for certain when it ends: its prompt's prefilled part, or, once it
    decoded, its context but the last token (a draft kept past an end of generation may follow)."""
    if request.prefilled < len(request.prompt_tokens) - 1:
        return request.prompt_tokens[: request.prefilled]
    return request.context[:-1]


def _shared_start(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens a and b share from their start."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(differ[0]) if len(differ) else n


class HostCache:
    """Row caches copied to host memory (SavedRow), each under the tokens it holds, within a budget
    of bytes (None: no limit): the least recently used go first, and a copy whose tokens start
    another's is dropped (the longer one holds it all)."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.entries: OrderedDict[int, tuple[tuple[int, ...], SavedRow]] = OrderedDict()
        self.nbytes = 0
        self._ids = itertools.count()

    def holds(self, tokens: Sequence[int]) -> bool:
        """Whether a copy holds all of these tokens (they start its own)."""
        tokens = tuple(tokens)
        return any(held[: len(tokens)] == tokens for held, _ in self.entries.values())

    def put(self, tokens: Sequence[int], saved: SavedRow) -> None:
        """Keep a copy of a row holding `tokens` (unless another holds them all already), in place
        of any copy whose tokens start these."""
        tokens = tuple(tokens)
        if (self.budget is not None and saved.nbytes > self.budget) or self.holds(tokens):
            return
        for key, (held, _) in list(self.entries.items()):
            if tokens[: len(held)] == held:
                self.forget(key)
        self.entries[next(self._ids)] = (tokens, saved)
        self.nbytes += saved.nbytes
        while self.budget is not None and self.nbytes > self.budget:
            self.forget(next(iter(self.entries)))

    def longest(self, prompt: Sequence[int]) -> tuple[int, int] | None:
        """(key, shared tokens) of the copy that shares the longest start with `prompt`, or None."""
        best = max(((_shared_start(held, prompt), key) for key, (held, _) in self.entries.items()), default=None)
        return (best[1], best[0]) if best and best[0] else None

    def take(self, key: int) -> SavedRow:
        """A copy to read back (it stays, now the most recently used)."""
        self.entries.move_to_end(key)
        return self.entries[key][1]

    def forget(self, key: int) -> None:
        self.nbytes -= self.entries.pop(key)[1].nbytes


def _emit(tokens: Sequence[int], eog, budget: int) -> tuple[list[int], str]:
    """What a step emits of the tokens it kept: up to an end-of-generation token (not emitted) or
    until `budget` new tokens are spent, and why generation ends there ("eog", "length"; "" if
    it goes on)."""
    emitted = []
    for token in tokens:
        if token in eog:
            return emitted, "eog"
        emitted.append(token)
        if len(emitted) >= budget:
            return emitted, "length"
    return emitted, ""
