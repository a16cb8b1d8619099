"""Early exit with trained blocks (train.exit, drafters.early_exit.exit_model_path): the torch
blocks compute what the NumPy reference computes, the draft GGUF is the target's first layers plus
the head's blocks, and `specdec train early-exit:L+B` then `generate --draft head:FILE` keeps
greedy plain on the NumPy, torch and llama.cpp backends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from specdec.drafters import headfile
from specdec.errors import SpecdecError
from specdec.models.numpy_ref import load_numpy_model
from specdec.train import features

from .conftest import require_module
from .models.test_numpy_ref import write_tiny_gguf
from .test_train import interrupt_the_fifth_update, setup, write_data  # noqa: F401 (setup: a fixture)

torch = require_module("torch", "the train extra: pip install -e '.[train]'")

from specdec.train.exit import ExitHead, chain_summary, exit_states  # noqa: E402


def _features(model, tokens: list[list[int]]) -> features.Features:
    lengths = [len(t) for t in tokens]
    flat = np.concatenate([np.asarray(t, np.int32) for t in tokens])
    return features.Features(
        flat, flat, np.zeros((len(flat), model.n_embd), np.float16), np.concatenate([[0], np.cumsum(lengths)]),
        np.arange(len(tokens)),
    )  # fmt: skip


def _untrained_head(model, layers: int, blocks: int, tmp_path) -> tuple[ExitHead, str]:
    """An early-exit head whose blocks are still the target's own layers, saved as a head file."""
    head = ExitHead(model, layers, blocks, np.arange(model.vocab_size))
    info = headfile.HeadInfo(
        kind="early-exit", target_sha256=model.identity, target_name=model.name, n_embd=model.n_embd,
        vocab_size=model.vocab_size, steps=3, layers=layers, blocks=blocks,
    )  # fmt: skip
    path = str(tmp_path / f"exit-{layers}-{blocks}.head")
    headfile.save(path, info, head.file_tensors())
    return head, path


@pytest.mark.parametrize("arch", ["qwen2", "llama", "gpt2"])
def test_torch_blocks_compute_the_numpy_reference(tmp_path, arch):
    """States after L layers, then the untrained blocks (the target's layers L ..), the final norm
    and the head = the NumPy model's own early exit after L + B layers."""
    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, seed=4, n_layer=4, n_head_kv=2 if arch != "gpt2" else None)
    model = load_numpy_model(path, n_ctx=128)
    tokens = list(np.random.default_rng(0).integers(0, model.vocab_size, 40))
    f = _features(model, [tokens])
    states = exit_states(model, f, 1, tmp_path / "states", progress=False)
    head, _ = _untrained_head(model, 1, 2, tmp_path)
    with torch.no_grad():
        got = head.features(torch.from_numpy(states.astype(np.float32))).numpy() @ model.weights["output.weight"].T
    want = model.forward(tokens, n_layers=3)
    scale = np.abs(want).max()
    # states pass through float16 (the cache's type) between layer 1 and the blocks
    np.testing.assert_allclose(got, want, atol=0.02 * scale)
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9
    assert (tmp_path / "states" / "window-000000.npy").exists()  # cached: a second call reads it


def test_the_draft_gguf_is_the_targets_first_layers_and_the_heads_blocks(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    import gguf

    from specdec.drafters.early_exit import exit_model_path

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", seed=5, n_layer=4)
    model = load_numpy_model(path, n_ctx=128)
    _, head_path = _untrained_head(model, 2, 1, tmp_path)
    built = exit_model_path(model, head_path)
    assert exit_model_path(model, head_path) == built  # built once
    reader = gguf.GGUFReader(built)
    assert int(reader.fields["qwen2.block_count"].contents()) == 3
    original = {t.name: t for t in gguf.GGUFReader(path).tensors}
    names = {t.name for t in reader.tensors}
    assert not any(n.startswith("blk.3.") for n in names) and "blk.2.attn_q.weight" in names
    for t in reader.tensors:  # the target's own tensors byte for byte; the head's block quantised
        if not t.name.startswith("blk.2."):
            assert np.array_equal(t.data, original[t.name].data), t.name
    draft = load_numpy_model(built, n_ctx=128)
    tokens = list(np.random.default_rng(1).integers(0, model.vocab_size, 30))
    want = model.forward(tokens, n_layers=3)  # the block is still the target's layer 2 (Q8_0 now)
    got = draft.forward(tokens)
    np.testing.assert_allclose(got, want, atol=0.02 * np.abs(want).max())
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, "qwen2", seed=6, n_layer=4)
    with pytest.raises(SpecdecError, match="was trained for"):
        exit_model_path(load_numpy_model(other, n_ctx=128), head_path)


def test_exit_training_learns_and_a_checkpoint_resumes(setup, tmp_path, monkeypatch):  # noqa: F811
    """Held-out agreement beats the untrained blocks' (the target cut after L + B layers); Ctrl-C
    leaves a checkpoint and no head file; the same call resumes and the head file replaces it."""
    from specdec.train.exit import train_exit
    from specdec.train.trainer import TrainConfig

    model, corpus, _, _ = setup
    folder = features.collect(model, corpus, progress=False)
    f = features.load_features(folder)
    states = exit_states(model, f, 1, folder / "exit-1", progress=False)
    config = TrainConfig(kind="early-exit", layers=1, blocks=1, vocab=200, epochs=20, batch=4, lr=3e-3)
    out = tmp_path / "e.head"
    untrained = train_exit(model, model, f, TrainConfig(**{**config.__dict__, "epochs": 1e-9}), states, out, {}, False)
    out.unlink()
    interrupt_the_fifth_update(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train_exit(model, model, f, config, states, out, {"from": "test"}, progress=False)
    monkeypatch.undo()
    checkpoint = tmp_path / "e.head.ckpt"
    assert checkpoint.exists() and not out.exists()
    assert torch.load(checkpoint, weights_only=True)["update"] == 4
    info = train_exit(model, model, f, config, states, out, {"from": "test"}, progress=False)
    assert not checkpoint.exists() and out.exists()
    assert info.training["updates"] == int(np.ceil(20 * (f.n_windows - 1) / 4))  # one window held out
    before, after = untrained.held_out["agreement"], info.held_out["agreement"]
    assert after[0] > before[0] + 0.1, (before, after)
    assert info.held_out["tokens_per_step"] > untrained.held_out["tokens_per_step"]
    loaded, tensors = headfile.load(out)
    assert loaded == info and sorted(tensors) == sorted(f"blk.1.{n}" for n in model.layers[1])


def test_chain_summary_counts_runs_inside_each_window():
    agree = [np.array([1, 1, 0, 1, 1, 1], bool), np.array([0, 1], bool)]
    s = chain_summary(agree, 2)
    # window 1: chains start at 0..4: first agree 1,1,0,1,1 (4 of 5), both 1,0,0,1,1 (3); window 2: 0 of 1
    assert s["positions"] == 6
    assert s["chain"] == [round(4 / 6, 4), round(3 / 6, 4)]
    assert s["tokens_per_step"] == round(1 + 7 / 6, 3)


def _specdec(home, *args):
    return subprocess.run(
        [sys.executable, "-m", "specdec.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "SPECDEC_HOME": str(home)},
    )


def test_specdec_train_early_exit_then_draft_with_it(tmp_path):
    """The user's two commands: the head trained on a tiny target, then drafting with it on the
    NumPy, torch and llama.cpp backends (greedy = plain), alone, as a tree and inside auto."""
    home = tmp_path / "home"
    target = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(target, "qwen2", seed=3, n_layer=3, n_ctx=1024)
    data = tmp_path / "data"
    write_data(data)
    out = tmp_path / "e.head"
    run = _specdec(
        home, "train", "early-exit:1+1", "--backend", "numpy", "--target", str(target), "--data", "text", str(data),
        "--epochs", "2", "--vocab", "200", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"wrote {out}: early-exit head (1 layers + 1 trained)" in run.stdout
    info = headfile.read_info(out)
    assert (info.kind, info.layers, info.blocks) == ("early-exit", 1, 1)
    assert info.held_out["positions"] > 0 and info.training["tokens"] > 0
    assert not list(tmp_path.glob("*.ckpt"))
    backends = ["numpy", "torch"] + (["llama"] if _has_llama() else [])
    for backend in backends:
        common = ("generate", "--backend", backend, "--target", str(target), "--no-chat", "-n", "24", "--json")
        plain = _specdec(home, *common, "-p", "the cat", "--draft", "none")
        spec = _specdec(home, *common, "-p", "the cat", "--draft", f"head:{out}", "-k", "3")
        auto = _specdec(home, *common, "-p", "the cat", "--draft", "auto", "--draft-model", f"head:{out}")
        tree = _specdec(
            home,
            *common,
            "-p",
            "the cat",
            "--draft",
            f"head:{out}",
            "-k",
            "3",
            "--draft-width",
            "2",
            "--draft-nodes",
            "4",
        )  # a tree too (on torch through the target's own cache, elsewhere as a draft model)
        for r in (plain, spec, auto, tree):
            assert r.returncode == 0, r.stderr
        got = json.loads(spec.stdout)
        assert got["tokens"] == json.loads(plain.stdout)["tokens"] == json.loads(auto.stdout)["tokens"], backend
        assert json.loads(tree.stdout)["tokens"] == got["tokens"], backend
        assert got["stats"]["drafted"] > 0 and json.loads(tree.stdout)["stats"]["drafted"] > 0
    # bad kinds, too many layers, a head for another target
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, "qwen2", seed=5, n_layer=3)
    for args in (
        ("train", "early-exit:0+1", "--backend", "numpy", "--target", str(target), "--out", "x.head"),
        ("train", "early-exit:2+x", "--backend", "numpy", "--target", str(target), "--out", "x.head"),
        (
            "train",
            "early-exit:2+1",
            "--backend",
            "numpy",
            "--target",
            str(target),
            "--data",
            str(data),
            "--out",
            "x.head",
        ),
        ("generate", "--backend", "numpy", "--target", str(other), "--draft", f"head:{out}", "-p", "x"),
    ):
        run = _specdec(home, *args)
        errors = [line for line in run.stderr.splitlines() if line.startswith("specdec: error:")]
        assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, (args, run.stderr)


def _has_llama() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_the_shared_caches_blocks_are_the_draft_models_layers(tmp_path, monkeypatch, arch):
    """exit_blocks (the blocks alone, read by transformers' GGUF reader, no draft model loaded)
    gives the torch target the weights the head's draft model has at layers L .. L + B - 1, under
    transformers' names and Q/K layout (a llama GGUF's Q and K rows are permuted); an untrained
    head's blocks are the target's own layers, Q8_0-rounded."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    from specdec import load_model
    from specdec.drafters.early_exit import exit_blocks, exit_model_path
    from specdec.models.load import load_like

    path = tmp_path / f"{arch}.gguf"
    write_tiny_gguf(path, arch, seed=7, n_layer=4, n_head_kv=2)
    _, head_path = _untrained_head(load_numpy_model(path, n_ctx=128), 1, 2, tmp_path)
    target = load_model(str(path), backend="torch", device="cpu", n_ctx=128, progress=False)
    blocks = exit_blocks(target, head_path)
    draft = load_like(target, exit_model_path(target, head_path))
    own = list(target._decoder_layers())[1:3]
    for got, want, layer in zip(blocks, list(draft._decoder_layers())[1:3], own):
        got, want, layer = got.state_dict(), want.state_dict(), layer.state_dict()
        assert got.keys() == want.keys() == layer.keys()
        for name in got:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
            torch.testing.assert_close(got[name], layer[name], rtol=0, atol=0.02 * float(layer[name].abs().max()))
