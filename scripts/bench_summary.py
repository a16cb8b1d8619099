#!/usr/bin/env python3
"""Summarise one or more `specdec bench` results.jsonl files together (a suite benchmarked in several
short runs): the per-category table and the like-with-like table of summary.md, over all the rows.

    python scripts/bench_summary.py out-a/results.jsonl out-b/results.jsonl
"""

from __future__ import annotations

import json
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))


def main(paths: list[str]) -> int:
    from specdec.bench.report import _category_tables
    from specdec.bench.run import Row

    names = {f.name for f in fields(Row)}
    rows = [
        Row(**{k: v for k, v in json.loads(line).items() if k in names})
        for path in paths
        for line in Path(path).read_text().splitlines()
        if line.strip()
    ]
    methods = list(dict.fromkeys(["plain", *(r.method for r in rows)]))
    print("\n".join(_category_tables([r for r in rows if r.batch == 1], methods)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
