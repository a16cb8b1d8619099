"""`specdec costs`: the curve of a random-weight model from a config, its table and JSON, and one
line + exit 2 for every bad flag."""

from __future__ import annotations

import json

import pytest

from specdec.cli import main

from .conftest import needs_torch

TINY = {
    "_source": "a tiny qwen2 for the tests",
    "model_type": "qwen2",
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 1024,
    "eos_token_id": 299,
}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(TINY))
    return path


def run(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exc:  # argparse's errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_a_random_weight_curve_is_printed_and_saved(capsys, config, tmp_path):
    needs_torch()
    out = tmp_path / "curve.json"
    code, stdout, stderr = run(
        capsys,
        "costs",
        "--backend",
        "torch",
        "--device",
        "cpu",
        "--random-weights",
        str(config),
        "--draft-random-weights",
        str(config),
        "--rows",
        "1",
        "2",
        "--depths",
        "16",
        "40",
        "--repeats",
        "1",
        "--ctx",
        "128",
        "--out",
        str(out),
    )
    assert code == 0, stderr
    assert "1 row @ 16" in stdout and "2 rows @ 40" in stdout and f"wrote {out}" in stdout
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] and report["versions"]["transformers"]
    for role in ("target", "draft"):
        facts = report[role]
        assert (facts["layers"], facts["hidden"], facts["kv_heads"], facts["vocab"]) == (2, 32, 2, 300)
        assert (facts["device"], facts["dtype"], facts["cache"]) == ("cpu", "float32", "dynamic")
        assert [(c["rows"], c["depth"]) for c in facts["curves"]] == [(1, 16), (1, 40), (2, 16), (2, 40)]
        for curve in facts["curves"]:
            assert curve["widths"] == list(range(1, 17)) + [24, 32, 48, 64]
            assert all(s > 0 for s in curve["seconds"])


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--rows", "0"], "--rows"),
        (["--depths", "-5"], "--depths"),
        (["--repeats", "x"], "--repeats"),
        (["--backend", "gpu"], "--backend"),
        (["--dtype", "float8"], "--dtype"),
        (["--cache", "paged"], "--cache"),
        (["--random-weights", "{config}"], "--random-weights needs --backend torch"),
        (["--backend", "llama", "--cache", "static"], "--cache static needs --backend torch"),
        (["--backend", "torch", "--graphs"], "--graphs needs --cache static"),
        (["--backend", "torch", "--cache", "static", "--compile"], "--compile needs --graphs"),
        (["--backend", "llama", "--compile"], "--compile needs --backend torch"),
        (["--backend", "torch", "--depths", "4050"], "needs --ctx >= 4114"),
        (["--out", "/no/such/folder/curve.json"], "no such folder"),
        (["--backend", "torch", "--device", "cpu", "--random-weights", "/no/such.json"], "cannot read"),
        (
            [
                "--backend",
                "torch",
                "--device",
                "cpu",
                "--random-weights",
                "{config}",
                "--draft",
                "x",
                "--draft-random-weights",
                "{config}",
            ],
            "not both",
        ),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(capsys, config, argv, fragment):
    code, _, stderr = run(capsys, "costs", *[a.replace("{config}", str(config)) for a in argv])
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdec: error:") and fragment in lines[0], stderr


def test_a_cuda_device_without_cuda_is_a_user_error(capsys, config):
    needs_torch()
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    code, _, stderr = run(capsys, "costs", "--backend", "torch", "--device", "cuda", "--random-weights", str(config))
    assert code == 2 and "sees no CUDA GPU" in stderr and len(stderr.strip().splitlines()) == 1
