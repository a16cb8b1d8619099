"""Cost curves: what a target forward of W rows costs, measured, cached, and refined live.

On a CPU a forward of 2/5/9/16 rows costs about 1.65/3.1/4.7/6.3 single steps (measured on the
issue's 2-core EPYC), so width is the scarce resource the controller spends; on a GPU the curve is
nearly flat up to dozens of rows. Nothing here assumes either: the curve is timed on the machine.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from .models.base import packed
from .paths import specdec_home, write_cache_file
from .progress import Progress

EMA = 0.15  # weight of a new observation in the live cost ratios
NARROW = 16  # widths 1..NARROW are all timed: a draft model's drafts (k + 1 <= 9) live here
# and these: a batch's drafts, and one row's long free drafts inside a verbatim copy
# why: on a CPU a forward's cost per token keeps falling past 16 tokens; history: docs/results/provenance.md#wide
WIDE = (24, 32, 48, 64)
WIDTHS = tuple(range(1, NARROW + 1)) + WIDE
# A forward's cost grows with the depth of the cache it attends over, and not alike for every
# width: each query row reads the whole cache, so the added cost is roughly proportional to the
# width. The curve is timed at SHALLOW for every width and at DEEP for DEEP_WIDTHS; between and
# beyond them a forward's cost is linear in the depth.
# why: width is dearer deep in a long prompt, which one live ratio learned on plain steps cannot know;
# history: docs/results/provenance.md#shallow, docs/results/provenance.md#deep, docs/results/provenance.md#deep_widths
SHALLOW = 128
DEEP = 1024
DEEP_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
# A curve is cached only if it looks like a quiet machine's: repeats of one width on a quiet CPU
# agree within a few percent, and a forward of W tokens that costs more than W one-token forwards
# does so again when timed a second time beside the one-token forward (some kernels do: a slow
# spell does not come back on cue).
# why: a curve timed on a busy machine, once cached, is read by every later run;
# history: docs/results/provenance.md#busy_spread, docs/results/provenance.md#superlinear
BUSY_SPREAD = 1.25  # median / fastest repeat, the median over widths, above which: busy
SUPERLINEAR = 1.1  # cost(W) > this x W x cost(1): timed again; still so: the model's kernels
CACHE_VERSION = 2  # curves cached before the checks above are not trusted
# A model's first run times a coarse grid of the widths (every width where a CPU's curve has been
# seen to bend: the AVX2 EPYC's kernel cliff from 7 to 8 tokens among them) at FIRST_REPEATS; each
# later run times up to REFINE_TOKENS tokens' worth of the widths still missing, beside the
# narrowest (the scale that joins them to the cached curve), until the curve is whole. Between
# timed widths CostTable interpolates linearly. The deep curve is timed whole at FIRST_REPEATS:
# its cost is the fill of DEEP tokens (a 1.5B's forward of 1024 tokens: ~10 s here), paid once.
# why: a first `make demo` on the 2-core AVX2 EPYC sat about 6 minutes timing two models at 20
# widths x 7 repeats; history: docs/results/provenance.md#first
FIRST = (1, 2, 3, 4, 6, 7, 8, 12, 16, 24, 32, 64)
FIRST_REPEATS = 3
REFINE_TOKENS = 40
# A step's forward whose rows, fed in two forwards, are priced at least SPLIT_GAIN less than in
# one is fed in two (split_forward), each half again while that pays, in at most SPLIT_PARTS: the
# curve is not always concave. On the 2-core EPYC, ggml's tiled K-quant matmul takes the Q6_K
# matrices (the 1.5B Q4_K_M's output head among them) from 8 rows on, where it is dearer than the
# one-row dot products: 8 rows with their logits cost 7.1 single steps, 4 + 4 of them 6.3.
# why: a server's 8 decoding rows, or 4 rows with a one-token draft each, sat on that cliff every
# step; history: docs/results/provenance.md#split_gain
SPLIT_GAIN = 0.05
SPLIT_PARTS = 4


def _cache_file(model, tag: str) -> Path | None:
    path = getattr(model, "path", None)
    if path is None:
        return None
    st = os.stat(path)
    key = (
        f"{os.path.abspath(path)} {st.st_size} {st.st_mtime_ns} {type(model).__name__} "
        f"{getattr(model, 'n_threads', '')} {tag}"
        + (f" exact {getattr(model, 'exact_build', None) or ''}".rstrip() if getattr(model, "exact", False) else "")
    )
    return specdec_home() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measure_forward_costs(
    model,
    widths: Sequence[int] | None = None,
    repeats: int = 7,
    depth: int = SHALLOW,
    use_cache: bool = True,
    rows: int = 1,
    first: Sequence[int] | None = None,
) -> dict[int, float]:
    """Seconds of one forward of W tokens in each of `rows` rows (rows x W tokens in all; one row:
    the verification of a k = W - 1 draft) at a cache depth of `depth` tokens per row, for each W
    in `widths`, the fastest of `repeats` (another process stealing a core only ever adds time, so
    the minimum is the cost). Cached per model file, backend, threads and rows in
    $SPECDEC_HOME/costs/. With `first` (and a cache), the curve is timed in stages: the widths in
    `first` on the first run, then REFINE_TOKENS' worth of the rest a run; the widths timed so far
    are returned."""
    widths = sorted(widths or WIDTHS)
    tag = f"forward-v{CACHE_VERSION}-{','.join(map(str, widths))}-{depth}" + (f"-rows{rows}" if rows > 1 else "")
    cache = _cache_file(model, tag) if use_cache else None
    cached: dict[int, float] = {}
    if cache is not None and cache.is_file():
        try:
            cached = {int(w): float(s) for w, s in json.loads(cache.read_text()).items()}
            if not set(cached) <= set(widths) or not cached:
                cached = {}
        except (ValueError, AttributeError):
            cached = {}  # a damaged cache file is measured again
    if sorted(cached) == widths:
        return cached
    todo, name = widths, getattr(model, "name", "the model")
    missing = [w for w in widths if w not in cached]
    if first is None or cache is None:
        cached = {}  # timed whole
    else:
        repeats = FIRST_REPEATS
        if cached:  # a later run: a few more widths beside the narrowest cached one
            todo = [min(cached)]
            for w in missing:
                if len(todo) > 1 and sum(todo[1:]) + w > REFINE_TOKENS:
                    break
                todo.append(w)
        else:
            todo = [w for w in widths if w in first] or widths
    if cache is not None:  # a pause on a model's first run, a few seconds on the next few: say why
        if cached:
            what = f"refining {name}'s cost curve at {len(todo) - 1} more widths ({len(missing)} left)"
        else:
            what = f"timing {name}'s forward at {len(todo)} of {len(widths)} widths"
            what += " (the rest a few at a time on later runs)" if len(todo) < len(widths) else ""
        print(
            f"specdec: {what}, cache depth {depth}, for --draft auto (cached in {cache.parent})",
            file=sys.stderr,
            flush=True,
        )
    n_max = todo[-1]
    # arbitrary tokens, another stretch for every row
    contexts = [
        [int(t) % model.vocab_size for t in range(1000 + 97 * i, 1000 + 97 * i + depth + n_max)] for i in range(rows)
    ]
    ids = model.add_rows(rows)
    feed = lambda w: {r: c[depth : depth + w] for r, c in zip(ids, contexts)}  # noqa: E731
    back = {r: depth for r in ids}
    try:
        model.forward_rows({r: c[:depth] for r, c in zip(ids, contexts)})
        model.forward_rows(feed(n_max), {r: n_max for r in ids})  # warm-up: every weight page
        model.rollback_rows(back)
        times: dict[int, list[float]] = {w: [] for w in todo}
        # tokens each forward feeds: the bar's estimate of the time left weighs widths by them
        planned = repeats * sum(todo)  # (a width timed again past its round is not counted)
        bar = Progress(f"timing {getattr(model, 'name', 'the model')}", planned, "tok", cache is not None)

        def rounds(ws: Sequence[int]) -> None:
            # Widths take turns, round after round, so that a slow spell of the machine (another
            # process, clock changes) lands on every width alike instead of skewing the ratios.
            for _ in range(repeats):
                for w in ws:
                    t = time.perf_counter()
                    model.forward_rows(feed(w), {r: w for r in ids})
                    times[w].append(time.perf_counter() - t)
                    model.rollback_rows(back)
                    bar.update(min((bar.done or 0) + w, planned))

        rounds(todo)
        bar.close()
        # a width dearer than as many one-token forwards is a slow spell or the model's own kernels
        # (SUPERLINEAR): it is timed again beside the narrowest, and what holds then is the kernels
        steep = superlinear(_smoothed(times)) if not busy_spread(times) else []
        if steep:
            rounds([todo[0], *steep])
    finally:
        model.drop_rows(ids)
    costs = _smoothed(times)
    if cached:  # the new widths, scaled by the narrowest's cached cost, joined to the cached curve
        scale = cached[todo[0]] / costs[todo[0]]
        joined = {**{w: s * scale for w, s in costs.items()}, **cached}
        costs = dict(zip(sorted(joined), np.maximum.accumulate([joined[w] for w in sorted(joined)]).tolist()))
    busy = machine_was_busy(times, costs, retimed=steep)
    if busy:
        print(
            f"specdec: warning: the machine was busy while timing {getattr(model, 'name', 'the model')}'s "
            f"forward ({busy}); these costs are used for this run only (refined as it goes) and "
            f"timed again next time",
            file=sys.stderr,
            flush=True,
        )
    elif cache is not None:
        write_cache_file(cache, json.dumps({str(w): s for w, s in costs.items()}))
    return costs


def measure_cost_table(model) -> "CostTable":
    """The model's cost table for the controller: every width timed at SHALLOW and DEEP_WIDTHS at
    DEEP (both cached; the shallow curve timed in stages, FIRST on a model's first run), or the
    shallow curve alone when DEEP tokens and a widest forward would not fit the model's context."""
    shallow = measure_forward_costs(model, first=FIRST)
    if model.n_ctx < DEEP + max(DEEP_WIDTHS):
        return CostTable(shallow)
    return CostTable(shallow, deep=measure_forward_costs(model, DEEP_WIDTHS, repeats=5, depth=DEEP, first=DEEP_WIDTHS))


def _smoothed(times: Mapping[int, Sequence[float]]) -> dict[int, float]:
    """Each width's fastest repeat (another process only ever adds time), made non-decreasing in
    the width (wider is never cheaper: what remains of the noise)."""
    widths = sorted(times)
    best = np.maximum.accumulate([min(times[w]) for w in widths])
    return {w: float(s) for w, s in zip(widths, best)}


def busy_spread(times: Mapping[int, Sequence[float]]) -> str:
    """Why repeats of one width disagree as on a busy machine ('' if they agree: BUSY_SPREAD)."""
    spread = float(np.median([np.median(t) / min(t) for t in times.values() if len(t) > 1] or [1.0]))
    return f"repeats differ: the median is {spread:.2f}x the fastest" if spread > BUSY_SPREAD else ""


def superlinear(costs: Mapping[int, float]) -> list[int]:
    """The widths whose forward costs more than SUPERLINEAR x W forwards of the narrowest."""
    w0 = min(costs)
    return [w for w, s in costs.items() if s > SUPERLINEAR * (w / w0) * costs[w0]]


def machine_was_busy(
    times: Mapping[int, Sequence[float]], costs: Mapping[int, float], retimed: Sequence[int] = ()
) -> str:
    """Why a timing looks taken on a busy machine ('' if it does not): repeats that disagree, or
    a forward of W tokens costing more than W forwards of one, unless W was `retimed` beside the
    narrowest and still did (then it is the model's kernels, not the machine)."""
    if spread := busy_spread(times):
        return spread
    w0 = min(costs)
    for w in superlinear(costs):
        if w not in retimed:
            return f"{w} tokens cost {costs[w] / costs[w0]:.1f}x {w0}"
    return ""


# -- the `specdec costs` report ---------------------------------------------------------------


def cost_report(
    model,
    rows: Sequence[int] = (1,),
    depths: Sequence[int] = (128,),
    repeats: int = 5,
    widths: Sequence[int] | None = None,
) -> list[dict]:
    """One curve per (rows, depth): {"rows", "depth", "widths", "seconds"}, seconds[i] the cost of
    a forward of widths[i] tokens in each of `rows` rows (measure_forward_costs, not cached:
    a report is a fresh measurement)."""
    curves = []
    for n in rows:
        for depth in depths:
            costs = measure_forward_costs(model, widths, repeats=repeats, depth=depth, use_cache=False, rows=n)
            curves.append({"rows": n, "depth": depth, "widths": list(costs), "seconds": list(costs.values())})
    return curves


def cost_table(report: dict, role: str = "target") -> "CostTable":
    """A `specdec costs` report's one-row curves as the controller takes them: the shallowest curve,
    and the deepest as its deep curve (none when the report timed one depth)."""
    curves = sorted((c for c in report[role]["curves"] if c["rows"] == 1), key=lambda c: c["depth"])
    if not curves:
        raise ValueError(f"the report has no one-row {role} curve")
    shallow, deep = curves[0], curves[-1]
    seconds = lambda c: dict(zip(c["widths"], c["seconds"]))  # noqa: E731
    if deep is shallow:
        return CostTable(seconds(shallow), depth=shallow["depth"])
    return CostTable(seconds(shallow), deep=seconds(deep), depth=shallow["depth"], deep_depth=deep["depth"])


def format_curves(name: str, curves: list[dict]) -> str:
    """The curves as a table: a line per width, milliseconds and the ratio to one token, a column
    pair per (rows, depth)."""
    heads = [f"{c['rows']} row{'s' if c['rows'] > 1 else ''} @ {c['depth']}" for c in curves]
    lines = [name, f"{'width':>6}" + "".join(f"{h:>24}" for h in heads)]
    widths = sorted({w for c in curves for w in c["widths"]})
    for w in widths:
        cells = []
        for c in curves:
            if w in c["widths"]:
                s = c["seconds"][c["widths"].index(w)]
                cells.append(f"{s * 1e3:12.2f} ms {s / c['seconds'][0]:6.2f}x")
            else:
                cells.append(" " * 24)
        lines.append(f"{w:>6}" + "".join(f"{cell:>24}" for cell in cells))
    one_row = [c for c in curves if c["rows"] == 1]
    if one_row:  # where the engine feeds W one-token rows (a batch's plain step) in more than one forward
        shallow = min(one_row, key=lambda c: c["depth"])
        table = CostTable(dict(zip(shallow["widths"], shallow["seconds"])))
        split = [w for w in shallow["widths"] if len(split_forward(dict.fromkeys(range(w), 1), packed, table)[0]) > 1]
        lines.append(
            f"split: {', '.join(map(str, split))} one-token rows go in more than one forward (costs.split_forward)"
            if split
            else "split: none (no width costs more than its rows in two forwards)"
        )
    return "\n".join(lines)


class CostTable:
    """target_cost(W, depth) for a forward of width W over a cache `depth` tokens deep: the measured
    curve (linear between measured widths; past the widest, its upper half's marginal cost:
    `measured`), moved to `depth` along the deep curve when there is one (`at_depth`), times the drift
    learned live: the machine's factor (`overall`, from every forward: the machine got faster or
    slower) times the curve's shape error at that width where it was seen (`shape`, the width's live
    ratio over the machine's). Without a depth, or without a deep curve, the curve's own depth."""

    def __init__(
        self,
        costs: dict[int, float] | Sequence[float],
        deep: dict[int, float] | None = None,
        depth: int = SHALLOW,
        deep_depth: int = DEEP,
    ):
        if not isinstance(costs, dict):  # a list: seconds for widths 1..len
            costs = {w: s for w, s in enumerate(costs, 1)}
        self.widths = sorted(costs)
        self.seconds = [costs[w] for w in self.widths]
        self.depth = depth
        self.overall = 1.0  # live seconds / measured seconds, the machine's factor
        self.shape: dict[int, float] = {}  # width -> its live ratio over `overall`
        self._seen: dict[int, int] = {}  # width -> forwards observed at it
        self._forwards = 0
        # a forward that scores a tree over a chain's of as many tokens (its mask, its positions;
        # on llama.cpp a sequence per leaf): learned from the steps that scored trees alone
        self.tree = 1.0
        self._trees = 0
        # seconds per token of depth at the deep curve's widths, never negative and never less for
        # a wider forward (more query rows read the cache: a deep forward timed faster than the
        # shallow one, or a wide one gaining less than a narrower one, is noise; on this CPU a
        # quiet timing gave 16 tokens 18 us a token of depth between 8 tokens' 44 and 32's 170)
        self.slopes: dict[int, float] = {}
        if deep:
            if deep_depth <= depth:
                raise ValueError(f"the deep curve's depth ({deep_depth}) must exceed the curve's ({depth})")
            widths = sorted(deep)
            rises = [max(0.0, (deep[w] - self.measured(w)) / (deep_depth - depth)) for w in widths]
            self.slopes = dict(zip(widths, np.maximum.accumulate(rises).tolist()))
        self._slope_points = (list(self.slopes), list(self.slopes.values()))  # for at_depth, every step

    @classmethod
    def of(cls, curve) -> "CostTable":
        """Any cost curve as a CostTable: a CostTable as it is, {width: seconds}, or a list of seconds
        for widths 1..W (a curve at one depth)."""
        return curve if isinstance(curve, cls) else cls(curve)

    @property
    def base(self) -> dict[int, float]:
        return dict(zip(self.widths, self.seconds))

    def measured(self, w: float) -> float:
        ws, ss = self.widths, self.seconds
        if w > ws[-1]:
            # Past the widest timed forward (a draft model catching up on a whole prompt): the
            # curve's marginal cost per token over its upper half, but at least half the widest
            # forward's cost per token (the one-way smoothing in measure_forward_costs can flatten
            # the top of a curve) and at most all of it (a forward's cost per token only falls with
            # width). Measured on this CPU (torch, the 0.5B draft, 2026-11-23): catch-ups of
            # 332/429/815 tokens took 1.40/1.64/3.20 s; this predicts 1.45/1.80/3.22 s, the
            # proportional rule it replaces 2.43/3.14/5.97 s.
            top, wide = ss[-1], ws[-1]
            slope = (top - self.measured(wide / 2)) / (wide / 2)
            return top + (w - wide) * min(max(slope, top / (2 * wide)), top / wide)
        return _interpolate(ws, ss, w)

    def at_depth(self, w: float, depth: float | None) -> float:
        """The measured cost of width w at `depth`: linear in the depth, its slope per width
        interpolated between the deep curve's widths (proportional to w outside them: each query
        row reads the whole cache). Depths under 0 count as 0."""
        if depth is None or not self.slopes:
            return self.measured(w)
        ws, ss = self._slope_points
        slope = _interpolate(ws, ss, w) if w <= ws[-1] else ss[-1] * w / ws[-1]
        return self.measured(w) + (max(depth, 0.0) - self.depth) * slope

    def drift(self, w: int) -> float:
        """Live seconds over measured at width w: the machine's factor, times the curve's error at w
        where w was seen. Not a ratio learned at w alone: a width met rarely would keep the ratio of
        the moment it was last seen while the machine moved on (measured on this CPU, 2026-11-29: in
        a slow phase a 2-token forward priced 1.22-1.53 plain steps took 1.9, and drafts passed the
        step bound)."""
        return self.overall * self.shape.get(w, 1.0)

    def __call__(self, w: int, depth: float | None = None) -> float:
        return self.at_depth(w, depth) * self.drift(w)

    def observe(self, passes: Sequence[int], seconds: float, depth: float | None = None, tree: bool = False) -> None:
        """A forward of these passes over the weights (their widths) took `seconds`: the machine's
        factor learns the forward's ratio to the curve, whatever its widths (the mean of the
        forwards seen until there are 1 / EMA: the first sets it, so the shapes do not take a
        machine slower than its curve for their own); then each of the passes' widths learns its
        ratio over the machine's factor (a width seen alone keeps a shape near 1: the machine's
        drift goes to the machine's factor, which every width follows), as the mean of its
        forwards (the prior 1 one of them) until there are 1 / EMA.

        A step that scored a tree (`tree`) teaches the tree factor its ratio over the chain price
        of its widths (the mean, the prior 1 one of them, until there are 1 / EMA), and the
        machine's factor that ratio over the tree factor; not the widths' shapes, which are the
        chains' (else a tree's price over a chain's, 1.04-1.07 on the H100 and H200, read as the
        width's shape priced every chain of that width as a tree)."""
        passes = [w for w in passes if w >= 1]
        if not passes or seconds <= 0:
            return
        r = seconds / sum(self.at_depth(w, depth) for w in passes)
        if tree:
            chain = sum(self.at_depth(w, depth) * self.drift(w) for w in passes)
            self._trees += 1
            self.tree += max(EMA, 1 / (self._trees + 1)) * (seconds / chain - self.tree)
            r /= self.tree
        self._forwards += 1
        self.overall += max(EMA, 1 / self._forwards) * (r - self.overall)
        if tree:
            return  # the widths' shapes are the chains'
        for w in set(passes):
            s, n = self.shape.get(w, 1.0), self._seen.get(w, 0) + 1
            self.shape[w] = s + max(EMA, 1 / (n + 1)) * (r / self.overall - s)
            self._seen[w] = n


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """ys at x, linear between the points; below the first, proportional to x (0 at x = 0)."""
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    i = bisect.bisect_left(xs, x)
    if i == len(xs):
        return ys[-1]
    if xs[i] == x:
        return ys[i]
    f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
    return ys[i - 1] + f * (ys[i] - ys[i - 1])


def split_forward(
    fed: Mapping[int, int],
    passes: Callable[[Mapping[int, int]], Sequence[int]],
    cost: Callable[[int, float | None], float],
    depth: float | None = None,
    parts: int = SPLIT_PARTS,
) -> tuple[list[dict[int, int]], float]:
    """The forwards to feed fed[row] tokens to each row in, and their price: each forward's passes
    over the weights (`passes`, the target's RowModel.passes) priced by cost(width, depth). One
    forward, or the rows (each whole) in two of about equal tokens, cut in row order (llama.cpp's
    streams make one pass of a run of consecutive rows), where the two are priced at least
    SPLIT_GAIN under the one; each half split again the same way, at most `parts` forwards."""
    fed = dict(fed)
    whole = sum(cost(w, depth) for w in passes(fed))
    if parts < 2 or len(fed) < 2:
        return [fed], whole
    rows = sorted(fed)
    before = np.cumsum([fed[r] for r in rows[:-1]])
    cut = int(np.argmin(np.abs(2 * before - sum(fed.values())))) + 1  # the cut nearest half the tokens
    halves = [{r: fed[r] for r in rows[:cut]}, {r: fed[r] for r in rows[cut:]}]
    if sum(cost(w, depth) for half in halves for w in passes(half)) > (1 - SPLIT_GAIN) * whole:
        return [fed], whole
    left, a = split_forward(halves[0], passes, cost, depth, parts // 2)
    right, b = split_forward(halves[1], passes, cost, depth, parts - parts // 2)
    return left + right, a + b


def step_depth(tokens: Mapping[int, int], depths: Mapping[int, int]) -> float:
    """The depth of a step's forward: each row's cache depth weighted by the tokens it feeds (the
    attention work of a row is its tokens times its depth)."""
    total = sum(tokens.values())
    return sum(n * depths[row] for row, n in tokens.items()) / total if total else 0.0
