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
import time
from pathlib import Path
from typing import Sequence

import numpy as np

EMA = 0.15          # weight of a new observation in the live cost ratios
NARROW = 16         # widths 1..NARROW are all timed: one row's drafts (k + 1 <= 16) live here
WIDE = (24, 32, 48, 64)   # and these, when the model holds several rows (a batch's drafts)


def widths_for(max_rows: int) -> list[int]:
    """The widths timed for a model that holds max_rows rows."""
    return list(range(1, NARROW + 1)) + ([w for w in WIDE] if max_rows > 1 else [])


def _cache_file(model, tag: str) -> Path | None:
    from .catalog import specdec_home

    path = getattr(model, "path", None)
    if path is None:
        return None
    st = os.stat(path)
    key = f"{os.path.abspath(path)} {st.st_size} {st.st_mtime_ns} {type(model).__name__} " \
          f"{getattr(model, 'n_threads', '')} {tag}"
    return specdec_home() / "costs" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def measure_forward_costs(model, widths: Sequence[int] | None = None, repeats: int = 7, depth: int = 128,
                          use_cache: bool = True) -> dict[int, float]:
    """Seconds of one forward of W rows (one row of W tokens) at a cache depth of `depth` tokens,
    for each W in `widths`, the fastest of `repeats` (another process stealing a core only ever
    adds time, so the minimum is the cost). Cached per model file, backend and threads in
    $SPECDEC_HOME/costs/."""
    widths = sorted(widths or widths_for(getattr(model, "max_rows", 1)))
    cache = _cache_file(model, f"forward-{','.join(map(str, widths))}-{depth}") if use_cache else None
    if cache is not None and cache.is_file():
        try:
            costs = {int(w): float(s) for w, s in json.loads(cache.read_text()).items()}
            if sorted(costs) == widths:
                return costs
        except (ValueError, AttributeError):
            pass   # a damaged cache file is measured again
    n_max = widths[-1]
    context = [int(t) % model.vocab_size for t in range(1000, 1000 + depth + n_max)]  # arbitrary tokens
    [row] = model.add_rows(1)
    try:
        model.forward_rows({row: context[:depth]})
        model.forward_rows({row: context[depth:depth + n_max]}, {row: n_max})   # warm-up: every weight page
        model.rollback_rows({row: depth})
        # Widths take turns, round after round, so that a slow spell of the machine (another
        # process, clock changes) lands on every width alike instead of skewing the ratios.
        times: dict[int, list[float]] = {w: [] for w in widths}
        for _ in range(repeats):
            for w in widths:
                t = time.perf_counter()
                model.forward_rows({row: context[depth:depth + w]}, {row: w})
                times[w].append(time.perf_counter() - t)
                model.rollback_rows({row: depth})
    finally:
        model.drop_rows([row])
    best = np.maximum.accumulate([min(times[w]) for w in widths])   # wider is never cheaper: smooth noise
    costs = {w: float(s) for w, s in zip(widths, best)}
    if cache is not None:
        from .catalog import write_cache_file
        write_cache_file(cache, json.dumps({str(w): s for w, s in costs.items()}))
    return costs


class CostTable:
    """target_cost(W) for a forward of width W: the measured curve (linear between measured
    widths, proportional past the widest) times a ratio learned live, per width where that width
    was seen, else the ratio over all widths (the machine got faster or slower)."""

    def __init__(self, costs: dict[int, float] | Sequence[float]):
        if not isinstance(costs, dict):                 # a list: seconds for widths 1..len
            costs = {w: s for w, s in enumerate(costs, 1)}
        self.widths = sorted(costs)
        self.seconds = [costs[w] for w in self.widths]
        self.ratio: dict[int, float] = {}               # width -> live seconds / measured seconds
        self.overall = 1.0

    @property
    def base(self) -> dict[int, float]:
        return dict(zip(self.widths, self.seconds))

    def measured(self, w: int) -> float:
        ws, ss = self.widths, self.seconds
        if w >= ws[-1]:
            return ss[-1] * w / ws[-1]
        if w <= ws[0]:
            return ss[0] * w / ws[0]
        i = bisect.bisect_left(ws, w)
        if ws[i] == w:
            return ss[i]
        f = (w - ws[i - 1]) / (ws[i] - ws[i - 1])
        return ss[i - 1] + f * (ss[i] - ss[i - 1])

    def __call__(self, w: int) -> float:
        return self.measured(w) * self.ratio.get(w, self.overall)

    def observe(self, w: int, seconds: float) -> None:
        if w < 1 or seconds <= 0:
            return
        r = seconds / self.measured(w)
        self.overall += EMA * (r - self.overall)
        self.ratio[w] = self.ratio.get(w, self.overall) + EMA * (r - self.ratio.get(w, self.overall))
