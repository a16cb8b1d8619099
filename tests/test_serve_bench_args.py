"""The serving benchmarks' bad input: a suite they cannot use is one line and exit 2, before any
server starts or any request is sent (benchmarks/serve_compare.py and serve_overhead.py start
servers for minutes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    # a URL nothing listens on: were a request sent, it would fail otherwise than asserted
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("script", ["serve_compare.py", "serve_load.py", "serve_overhead.py"])
@pytest.mark.parametrize(
    "suite_text, extra, fragment",
    [
        (None, [], "cannot read the suite"),
        ('{"category": "qa", "prompt": "hi"}\nnot json\n', [], ":2: not a JSON object"),
        ('{"category": "qa"}\n', [], ":1: not a JSON object"),
        ('{"category": "qa", "prompt": "hi"}\n', ["--categories", "math"], "no prompt to send"),
        ('{"category": "qa", "prompt": "hi"}\n', ["-n", "0"], "-n must be at least 1"),
    ],
)
def test_a_bad_suite_is_one_line_and_exit_2(tmp_path, script, suite_text, extra, fragment):
    suite = tmp_path / "suite.jsonl"
    if suite_text is not None:
        suite.write_text(suite_text)
    url = {"serve_load.py": ["--url", "http://127.0.0.1:9/v1"], "serve_compare.py": ["--servers", "specdec:none"]}
    url = url.get(script, [])
    proc = _run(script, *url, "--suite", str(suite), *extra)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr
    assert "| server" not in proc.stdout  # no table begun: nothing ran


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--rounds", "0"], "--rounds must be at least 1"),
        (["--max-tokens", "1"], "--max-tokens must be at least 2"),
        (["-c", "0"], "--concurrency must be at least 1"),
        (["--llama-bin", "/nonexistent"], "no llama-server in /nonexistent"),
    ],
)
def test_serve_overhead_refuses_a_run_it_cannot_measure_before_loading_anything(args, fragment):
    proc = _run("serve_overhead.py", *args)
    assert proc.returncode == 2, proc.stderr
    assert fragment in proc.stderr and "Traceback" not in proc.stderr
    assert "| arm" not in proc.stdout and "round 1" not in proc.stdout
