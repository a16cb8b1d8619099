"""`specdec generate / compare --backend torch` end to end on tiny transformers models saved to a
folder: batch mode, JSON lines, greedy equality with one-prompt runs, and its user errors."""

from __future__ import annotations

import json

import pytest

from .conftest import needs_torch

needs_torch()

from . import tiny_hf  # noqa: E402
from .test_user_errors import assert_user_error, specdec  # noqa: E402

PROMPTS = ["def add(a, b):", "The quick brown fox", "class Point:", "lazy dog."]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    tokenizer = tiny_hf.tokenizer()
    target, draft = tiny_hf.pair("qwen2", len(tokenizer))
    for model, name in ((target, "target"), (draft, "draft")):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n\n")
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return root


def torch_flags(root, *extra):
    return [
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--target",
        str(root / "target"),
        "--draft",
        str(root / "draft"),
        "-k",
        "3",
        "--no-chat",
        "-n",
        "24",
        *extra,
    ]


def test_batch_mode_prints_a_json_line_per_prompt_equal_to_single_runs(folders):
    proc = specdec(
        "generate",
        *torch_flags(folders, "--prompt-file", str(folders / "prompts.txt"), "--batch-size", "3", "--json", "--stats"),
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    assert "summed over the batch" in proc.stderr
    for prompt, row in zip(PROMPTS, rows):
        alone = specdec("generate", *torch_flags(folders, "-p", prompt, "--json"))
        assert alone.returncode == 0, alone.stderr
        assert json.loads(alone.stdout)["tokens"] == row["tokens"]
        assert row["stats"]["drafted"] > 0


def test_a_draft_tree_from_the_command_line_writes_the_chains_text(folders):
    """--draft-width 3: the draft model's top 3 at each depth, one target forward over the tree;
    greedy, the same tokens as the chain, with the siblings drafted too."""
    runs = {}
    for width in ("1", "3"):
        proc = specdec("generate", *torch_flags(folders, "-p", PROMPTS[0], "--json", "--stats", "--draft-width", width))
        assert proc.returncode == 0, proc.stderr
        runs[width] = json.loads(proc.stdout)
    assert runs["3"]["tokens"] == runs["1"]["tokens"]
    assert runs["3"]["stats"]["drafted"] > runs["1"]["stats"]["drafted"]


def test_batch_mode_reads_jsonl_and_prints_text(folders):
    proc = specdec("generate", *torch_flags(folders, "--prompt-file", str(folders / "prompts.jsonl"), "-b", "4"))
    assert proc.returncode == 0, proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("--- ")] == [
        "--- 0 ---",
        "--- 1 ---",
        "--- 2 ---",
        "--- 3 ---",
    ]


def test_an_early_exit_on_the_torch_backend_from_the_command_line(folders):
    """--draft early-exit:1: the target's first layer drafts through its own cache; compare says
    the speculative text is plain's, and a batch's rows, chains or trees, equal plain's."""
    flags = torch_flags(folders, "-p", PROMPTS[1])
    flags[flags.index("--draft") + 1] = "early-exit:1"
    proc = specdec("compare", *flags)
    assert proc.returncode == 0, proc.stderr
    assert "identical" in proc.stdout
    batch = torch_flags(folders, "--prompt-file", str(folders / "prompts.txt"), "-b", "4", "--json", "--stats")
    batch[batch.index("--draft") + 1] = "early-exit:1"
    plain = torch_flags(folders, "--prompt-file", str(folders / "prompts.txt"), "-b", "4", "--json")
    plain[plain.index("--draft") + 1] = "none"
    tree = [*batch, "--draft-width", "2", "--draft-nodes", "3"]  # the exit's tree, 3 nodes a step
    runs = [specdec("generate", *args) for args in (batch, plain, tree)]
    assert all(r.returncode == 0 for r in runs), [r.stderr for r in runs]
    spec, base, trees = ([json.loads(line) for line in r.stdout.splitlines()] for r in runs)
    assert [r["tokens"] for r in spec] == [r["tokens"] for r in base] == [r["tokens"] for r in trees]
    assert sum(r["stats"]["drafted"] for r in spec) > 0 and sum(r["stats"]["drafted"] for r in trees) > 0


def test_compare_on_the_torch_backend(folders):
    proc = specdec("compare", *torch_flags(folders, "-p", PROMPTS[0]))
    assert proc.returncode == 0, proc.stderr
    assert "identical" in proc.stdout and "speedup" in proc.stdout


def test_the_static_cache_from_the_command_line_writes_the_dynamic_caches_tokens(folders):
    """--cache static (the layout CUDA graphs replay over; with SPECDEC_TEST_DEVICE=cuda, --graphs
    too): a batch of rows, target and draft model over preallocated buffers, writes what the
    default dynamic cache writes, with drafts kept."""
    layouts = [["--cache", "dynamic"], ["--cache", "static"]]
    if tiny_hf.DEVICE.startswith("cuda"):
        layouts.append(["--cache", "static", "--graphs"])
    runs = []
    for layout in layouts:
        flags = torch_flags(folders, "--prompt-file", str(folders / "prompts.txt"), "-b", "3", "--json", "--stats")
        flags[flags.index("--device") + 1] = tiny_hf.DEVICE
        proc = specdec("generate", *flags, *layout)
        assert proc.returncode == 0, proc.stderr
        runs.append([json.loads(line) for line in proc.stdout.splitlines()])
    assert all([r["tokens"] for r in run] == [r["tokens"] for r in runs[0]] for run in runs)
    assert all(sum(r["stats"]["accepted"] for r in run) > 0 for run in runs)


def test_torch_user_errors(folders, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt field"}\n')
    assert_user_error(specdec("generate", *torch_flags(folders, "--prompt-file", str(bad), "-b", "2")), "bad.jsonl:2")
    assert_user_error(
        specdec("generate", *torch_flags(folders, "-p", "x", "--cache", "static", "--graphs")),
        "--graphs needs a CUDA device (--device cuda); this one is cpu",
    )
    assert_user_error(
        specdec(
            "generate", "--backend", "torch", "--device", "cpu", "--target", str(tmp_path), "--draft", "none", "-p", "x"
        ),
        "config.json",
    )
    other = tmp_path / "other"  # a draft of another vocabulary
    tokenizer = tiny_hf.tokenizer(vocab_size=300)
    tiny_hf.pair("llama", len(tokenizer))[1].save_pretrained(other)
    tokenizer.save_pretrained(other)
    # a draft of another vocabulary is no longer refused: it drafts across tokenizers (string-level)
    proc = specdec(
        "generate",
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--target",
        str(folders / "target"),
        "--draft",
        str(other),
        "-k",
        "3",
        "-n",
        "8",
        "-p",
        "x",
    )
    assert proc.returncode == 0, proc.stderr


def test_bench_on_folders_with_a_batch_axis(folders, tmp_path):
    suite = tmp_path / "suite.jsonl"
    suite.write_text(
        "".join(json.dumps({"id": f"p{i}", "category": "chat", "prompt": p}) + "\n" for i, p in enumerate(PROMPTS))
    )
    out = tmp_path / "out"
    proc = specdec(
        "bench",
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--target",
        str(folders / "target"),
        "--draft",
        str(folders / "draft"),
        "--suite",
        str(suite),
        "--per-category",
        "4",
        "--batch-sizes",
        "1",
        "2",
        "--methods",
        "plain",
        "draft:3",
        "-n",
        "8",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["batch"], r["method"]) for r in rows) == sorted(
        [(1, m) for m in ("plain", "plain#2", "draft:3") for _ in range(4)]  # plain#2: the noise run
        + [(2, m) for m in ("plain", "draft:3") for _ in range(2)]
    )
    assert all(r["identical_to_plain"] for r in rows)
    assert all(r["tokens"] == 8 * r["batch"] for r in rows)
    assert "| 2 |" in (out / "summary.md").read_text()
