"""Helpers only the benchmarks and the replay use: a report's one-row curve as a list, and the
paired ratio of sums with its standard error."""

from __future__ import annotations

import math

from specdec.costs import CostTable


def single_row_curve(report: dict, role: str = "target", depth: int | None = None) -> list[float]:
    """Seconds of a forward of 1..W tokens in one row from a `specdec costs` JSON report (the
    curve at `depth`, else the shallowest; W its widest width, the widths between interpolated), as
    the controller and the replay take it."""
    curves = [c for c in report[role]["curves"] if c["rows"] == 1 and (depth is None or c["depth"] == depth)]
    if not curves:
        raise ValueError(f"the report has no one-row {role} curve" + (f" at depth {depth}" if depth else ""))
    curve = min(curves, key=lambda c: c["depth"])
    table = CostTable(dict(zip(curve["widths"], curve["seconds"])))
    return [table.measured(w) for w in range(1, table.widths[-1] + 1)]


def ratio_of_sums(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    """sum(a) / sum(b) over paired observations (a_i, b_i), and the ratio estimator's standard error
    over them: sqrt(sum (a_i - R b_i)^2 / (m (m - 1))) / mean(b). What the benchmarks that pair two
    methods on the same rows (benchmarks/verification_rules.py, draft_trees.py) report."""
    a, b = (sum(col) for col in zip(*pairs))
    r, m = a / b, len(pairs)
    return r, math.sqrt(sum((ai - r * bi) ** 2 for ai, bi in pairs) / (m * max(1, m - 1))) / (b / m)
