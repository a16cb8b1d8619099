"""Shared fixtures. Tests marked real_models use the built-in GGUF files through llama.cpp; they
skip when those are missing, except under SPECDEC_REQUIRE_MODELS=1 (set by `make test` and CI),
where a missing model is a failure rather than a silent skip."""

from __future__ import annotations

import importlib
import json
import os
from pathlib import Path

import pytest

REQUIRE = os.environ.get("SPECDEC_REQUIRE_MODELS") == "1"
# This CPU's cost curves of the 1.5B target and the 0.5B draft, a `specdec costs` report: what
# --costs gives auto in the tests that run it on the real models, so that none of them times a
# model (at one thread a worker, auto timed the two for 8 minutes at its first use)
SHIPPED_COSTS = Path(__file__).resolve().parents[1] / "benchmarks" / "cpu" / "costs-1.5b-0.5b.json"


def costs_report(folder, target: str = "qwen2.5-coder-1.5b", draft: str | None = "qwen2.5-coder-0.5b") -> str:
    """A --costs report for `target` and `draft` (None: none, as for --draft-model none), written
    in `folder`: the shipped curves, relabelled, the 0.5B's standing in for any model but the
    1.5B target (curves steer auto's choices, never its output; see --costs)."""
    if (target, draft) == ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"):
        return str(SHIPPED_COSTS)
    shipped = json.loads(SHIPPED_COSTS.read_text())
    report = dict(shipped, target=dict(shipped["target" if target == "qwen2.5-coder-1.5b" else "draft"], name=target))
    report.pop("draft")
    if draft is not None:
        report["draft"] = dict(shipped["draft"], name=draft)
    path = Path(folder) / f"costs-{target}-{draft}.json"
    path.write_text(json.dumps(report))
    return str(path)


def pytest_configure(config):
    """Under pytest-xdist (`make test` runs two workers) each worker keeps its own share of the
    cores, and the processes it starts inherit it: llama.cpp sizes its threads from this affinity
    (default_threads) and torch from what OpenMP sees, so one worker's threads never spin waiting
    for a core the other worker holds."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if worker.startswith("gw") and count > 1 and hasattr(os, "sched_setaffinity"):
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) >= count:
            os.sched_setaffinity(0, cores[int(worker[2:]) :: count])


# Seconds each of the suite's heaviest files took on one worker's core (a clean clone's `make test`
# with --junitxml on the 2-core AVX2 EPYC, 2026-12-02, setup and teardown included). The files run
# heaviest first, the rest after them in their own order: pytest-xdist hands the next file to the
# worker that is free (Makefile: --dist loadfile --no-loadscope-reorder), so the long files overlap
# and the short ones fill in at the end, where before test_exact.py's 10 minutes ran last, alone.
FILE_SECONDS = {
    "tests/test_greedy_real.py": 806,
    "tests/test_exact.py": 760,
    "tests/test_verify_rules.py": 632,
    "tests/test_sampled_engine.py": 378,
    "tests/server/test_real.py": 314,
    "tests/test_cli.py": 291,
    "tests/test_cross_vocab_real.py": 231,
    "tests/test_cli_torch.py": 200,
    "tests/test_user_errors.py": 190,
    "tests/test_check.py": 186,
    "tests/drafters/test_cross_vocab.py": 165,
    "tests/test_sampling.py": 131,
    "tests/test_torch_real.py": 111,
    "tests/test_replay.py": 94,
    "tests/test_batch.py": 90,
    "tests/test_train_exit.py": 77,
    "tests/drafters/test_early_exit.py": 71,
    "tests/models/test_llama_cpp.py": 56,
    "tests/models/test_numpy_ref.py": 53,
    "tests/test_train.py": 52,
    "tests/test_bench.py": 48,
}


def pytest_collection_modifyitems(config, items):
    """The heaviest files first (FILE_SECONDS); a stable sort, so a file's tests keep their order."""
    items.sort(key=lambda item: -FILE_SECONDS.get(item.nodeid.split("::")[0], 0))


def skip_or_fail(message: str):
    """Skip, or under SPECDEC_REQUIRE_MODELS=1 (make test, CI) fail: a required test runs or fails."""
    if REQUIRE:
        pytest.fail(message, pytrace=False)
    pytest.skip(message, allow_module_level=True)


def require_module(name: str, hint: str):
    """The module, imported; else skip_or_fail, naming it and how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        skip_or_fail(f"{name} is not installed: {hint}")


class Stopped(Exception):
    """Raised by a stand-in that captured_call put in place: the call was made and recorded."""


def captured_call(monkeypatch, owner, name: str) -> dict:
    """Replace owner.name with a stand-in that records the keyword arguments of its call in the
    returned dict and raises Stopped (what a command passes on, without running it)."""
    seen: dict = {}

    def stand_in(*args, **kwargs):
        seen.update(kwargs)
        raise Stopped

    monkeypatch.setattr(owner, name, stand_in)
    return seen


def needs_torch():
    """Skip (or, under SPECDEC_REQUIRE_MODELS=1, fail) when PyTorch or transformers is missing."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        skip_or_fail(f"the torch backend's packages are missing ({exc.name}): make torch-deps")


def _real_model(name: str):
    from specdec import catalog
    from specdec.errors import SpecdecError

    require_module("llama_cpp", "make setup")
    spec = catalog.lookup(name)
    if not catalog.is_assembled(spec):
        try:
            catalog.chunk_files(spec)
        except SpecdecError as exc:
            skip_or_fail(str(exc))
    from specdec import load_model

    return load_model(name, n_ctx=2048, progress=False)


@pytest.fixture(scope="session")
def target_model():
    return _real_model("qwen2.5-coder-1.5b")


@pytest.fixture(scope="session")
def draft_model():
    return _real_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def tokenizer():
    """The tiny byte-level BPE tokenizer of the torch backend's tests (tests/tiny_hf.py)."""
    from . import tiny_hf

    return tiny_hf.tokenizer()
