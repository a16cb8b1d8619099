"""`specdec train` (train/): features computed once and resumed, training that learns, a checkpoint
that survives Ctrl-C, and the head file it writes, drafting through the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from specdec.drafters import headfile
from specdec.errors import SpecdecError
from specdec.models.numpy_ref import load_numpy_model
from specdec.sampling import logits_to_probs, sample
from specdec.train import features

from .conftest import require_module
from .models.test_numpy_ref import write_tiny_gguf

torch = require_module("torch", "the train extra: pip install -e '.[train]'")

from specdec.train.trainer import TrainConfig, train  # noqa: E402

# a text with structure a head can learn (the target is random: what it says next is a function of
# the text, and repeating phrases make the next-but-one token predictable from the hidden state)
TEXT = " ".join(
    f"the cat {w} in a hat, the {w} then a cat" for w in ("sat", "ran", "hid", "ate", "saw", "dug", "won") * 12
)


@pytest.fixture()
def setup(tmp_path, monkeypatch):
    """A tiny target and 24 text files (one window each: the 20th is held out)."""
    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny-qwen2.gguf"
    write_tiny_gguf(path, "qwen2", seed=3, n_layer=3, n_ctx=1024)
    data = tmp_path / "data"
    write_data(data)
    model = load_numpy_model(path, n_ctx=features.WINDOW)
    corpus = features.Corpus(features.expand([str(data)]), 100_000, min_distinct=0.0)  # a vocabulary of letters
    return model, corpus, path, data


def test_features_are_the_targets_and_resume(setup, monkeypatch):
    model, corpus, _, _ = setup
    calls, interrupt = [], [3]
    forward = type(model).forward_rows

    def counted(self, tokens, n_logits=None):
        calls.append(1)
        if len(calls) == interrupt[0]:
            raise KeyboardInterrupt
        return forward(self, tokens, n_logits)

    monkeypatch.setattr(type(model), "forward_rows", counted)
    with pytest.raises(KeyboardInterrupt):
        features.collect(model, corpus, progress=False)
    folder = features.features_folder(model, corpus)
    assert len(list(folder.glob("window-*.npz"))) == 2  # the finished windows stay
    calls.clear()
    interrupt[0] = 0
    features.collect(model, corpus, progress=False)
    windows = list(features.windows(corpus, model.tokenizer))
    assert len(calls) == len(windows) - 2  # resumed: the two are not computed again
    monkeypatch.undo()
    f = features.load_features(folder)
    assert len(f.tokens) == sum(len(t) for _, t in windows) and f.n_windows == 24
    training, held = f.split()
    assert held.index.tolist() == [19] and training.n_windows == 23
    small = features.load_features(folder, max_tokens=1)  # a smaller budget: the first windows, the same held-out
    assert small.index.tolist() == [0, 19] and small.split()[1].index.tolist() == [19]
    first = windows[0][1]
    assert f.tokens[: len(first)].tolist() == first
    # the labels are the target's greedy tokens, the states its final-norm hidden states
    row = model.add_rows(1)[0]
    logits = model.forward_rows({row: first}, {row: len(first)})[row]
    assert f.labels[: len(first)].tolist() == logits.argmax(-1).tolist()
    output = model.head_weights("output", np.arange(model.vocab_size))
    np.testing.assert_allclose(f.hidden[:4].astype(np.float32) @ output.T, logits[:4], atol=0.05)
    model.drop_rows([row])
    assert json.loads((folder / "data.json").read_text())["files"] == 24


def test_the_draft_vocabulary_is_the_data_s_tokens_then_the_lowest_ids():
    from specdec.train.trainer import draft_vocabulary

    labels = np.array([7, 3, 7, 9, 3, 7, 1])
    assert draft_vocabulary(labels, 3, 100).tolist() == [7, 3, 1]  # most often first, ties by id
    assert draft_vocabulary(labels, 7, 100).tolist() == [7, 3, 1, 9, 0, 2, 4]  # then ids never predicted
    assert draft_vocabulary(labels, 50, 10).tolist() == [7, 3, 1, 9, 0, 2, 4, 5, 6, 8]  # at most every id


def interrupt_the_fifth_update(monkeypatch) -> None:
    """Ctrl-C as the optimiser takes its fifth step (after 4 updates); checkpoints only then."""
    from specdec.train import trainer

    steps = []
    real_step = torch.optim.AdamW.step

    def interrupt(self, *args, **kwargs):
        steps.append(1)
        if len(steps) == 5:
            raise KeyboardInterrupt
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", interrupt)
    monkeypatch.setattr(trainer, "CHECKPOINT_SECONDS", 1e9)  # only Ctrl-C writes one


def write_data(folder) -> None:
    """24 text files of TEXT, one window each (the 20th is held out)."""
    folder.mkdir()
    for i in range(24):
        (folder / f"part{i:02d}.txt").write_text(TEXT[i * 97 :][:300])


@pytest.mark.parametrize("kind", ["medusa", "prophet"])
def test_training_learns_and_a_checkpoint_resumes(setup, tmp_path, monkeypatch, kind):
    """Held-out agreement beats the untrained head's; Ctrl-C mid-training leaves a checkpoint (and
    no head file); the same call resumes from it and the head file replaces it."""
    from specdec.train import trainer

    model, corpus, _, _ = setup
    f = features.load_features(features.collect(model, corpus, progress=False))
    out = tmp_path / f"{kind}.head"
    config = TrainConfig(kind=kind, steps=2, vocab=200, epochs=4, batch=64, lr=3e-3, n_head=4, n_ff=32)
    untrained = train(model, f, TrainConfig(**{**config.__dict__, "epochs": 1e-9}), out, {}, progress=False)

    out.unlink()
    interrupt_the_fifth_update(monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        train(model, f, config, out, {"from": "test"}, progress=False)
    monkeypatch.undo()
    checkpoint = tmp_path / f"{kind}.head.ckpt"
    assert checkpoint.exists() and not out.exists()
    assert torch.load(checkpoint, weights_only=True)["update"] == 4
    info = train(model, f, config, out, {"from": "test"}, progress=False)
    assert not checkpoint.exists() and out.exists()
    total = int(config.epochs * len(trainer.start_positions(f.split()[0], 2)) / config.batch)
    assert info.training["updates"] == total
    assert info.data == {"from": "test"} and info.target_sha256 == model.identity
    before, after = untrained.held_out["agreement"], info.held_out["agreement"]
    assert after[0] > before[0] + 0.1, (before, after)  # the token after next: learned
    assert info.held_out["tokens_per_step"] > untrained.held_out["tokens_per_step"]
    loaded, tensors = headfile.load(out)
    assert loaded == info and len(tensors["vocab"]) <= 200


def test_specdec_train_then_generate_with_the_head(setup, tmp_path):
    """The two commands a user runs: a head trained, then drafting with it, greedy = plain."""
    _, _, target, data = setup
    env_home = str(tmp_path / "home")

    def specdec(*args):
        return subprocess.run(
            [sys.executable, "-m", "specdec.cli", *args],
            capture_output=True,
            text=True,
            timeout=600,
            env={**__import__("os").environ, "SPECDEC_HOME": env_home},
        )

    out = tmp_path / "m.head"
    run = specdec(
        "train", "medusa:2", "--backend", "numpy", "--target", str(target), "--data", str(data),
        "--epochs", "2", "--batch", "32", "--vocab", "200", "--out", str(out), "--no-progress",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"wrote {out}: medusa head (2 steps)" in run.stdout and out.exists()
    common = (
        "generate",
        "--backend",
        "numpy",
        "--target",
        str(target),
        "--no-chat",
        "-n",
        "24",
        "--json",
        "-p",
        "the cat",
    )
    plain = specdec(*common, "--draft", "none")
    spec = specdec(*common, "--draft", f"head:{out}", "-k", "2")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    got = json.loads(spec.stdout)
    assert got["tokens"] == json.loads(plain.stdout)["tokens"]
    assert got["stats"]["drafted"] > 0
    auto = specdec(*common, "--draft", "auto", "--draft-model", f"head:{out}")  # the head in auto
    assert auto.returncode == 0, auto.stderr
    assert json.loads(auto.stdout)["tokens"] == got["tokens"]
    # a head for another model (on NumPy and on torch), a missing head: one line, exit 2
    other = tmp_path / "other.gguf"
    write_tiny_gguf(other, "qwen2", seed=5, n_layer=3)
    for args in (
        ("generate", "--backend", "numpy", "--target", str(other), "--draft", f"head:{out}", "-p", "x"),
        ("generate", "--backend", "torch", "--target", str(other), "--draft", f"head:{out}", "-p", "x"),
        ("generate", "--backend", "numpy", "--target", str(target), "--draft", "head:/nonexistent.head", "-p", "x"),
        (
            "train",
            "medusa:2",
            "--backend",
            "numpy",
            "--target",
            str(target),
            "--data",
            "/nonexistent",
            "--out",
            "x.head",
        ),
        ("train", "medusa:2", "--backend", "numpy", "--target", str(target), "--rows", "0", "--out", "x.head"),
        ("train", "medusa:2", "--backend", "numpy", "--target", str(target), "--cache", "static", "--out", "x.head"),
    ):
        run = specdec(*args)
        errors = [line for line in run.stderr.splitlines() if line.startswith("specdec: error:")]
        assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr


def test_bad_training_input(setup, tmp_path):
    model, _, _, data = setup
    with pytest.raises(SpecdecError, match="no such file or folder"):
        features.expand([str(tmp_path / "missing")])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SpecdecError, match="no .py, .md, .rst or .txt files"):
        features.expand([str(empty)])
    short = tmp_path / "short.txt"
    short.write_text("the cat")  # under one window
    folder = features.collect(model, features.Corpus([short], 4000, min_distinct=0.0), progress=False)
    with pytest.raises(SpecdecError, match="no training text"):
        features.load_features(folder)


PROSE = (
    "The cat sat in a hat and then it ran to the shed. It hid there until the rain stopped, and then it "
    "came back to the house where the dog was asleep by the fire. Nobody saw it go, or come back in again."
)
SOURCE = '''def purr(n):
    """Return the sound a cat makes when it is happy, n times over, joined by spaces."""
    out = []
    for _ in range(n):
        out.append("purr")
    return " ".join(out)
'''


def _self_setup(tmp_path, monkeypatch):
    """A tiny target whose context holds a conversation, and a folder of sources (prose, a function)."""
    from specdec.train import conversations

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", seed=3, n_layer=2, n_ctx=2048)
    data = tmp_path / "data"
    data.mkdir()
    (data / "cats.md").write_text(f"# Cats\n\n{PROSE}\n\n{PROSE.upper()}\n")
    (data / "purr.py").write_text(SOURCE)
    return load_numpy_model(path, n_ctx=conversations.N_CTX), data


def test_self_data_is_the_targets_own_answers_and_resumes(tmp_path, monkeypatch):
    """`--data self`: requests made from the sources, answered by the target greedily, ROWS at
    a time; each conversation a window whose labels are the target's next tokens (in the answer:
    the answer's own next tokens), written whole, so Ctrl-C loses only the answers under way."""
    from specdec.train import conversations

    monkeypatch.setattr(conversations, "ANSWER_TOKENS", 24)
    model, data = _self_setup(tmp_path, monkeypatch)
    pools = conversations.read_pools(features.expand([str(data)]))
    assert pools.paragraphs and [f[1] for f in pools.functions] == ["purr(n)"] and not pools.modules
    asked = [conversations.request(i, pools) for i in range(40)]
    kinds = {category for category, _, _ in asked[:14]}
    assert kinds == {"code", "explain", "multi-turn", "summarise", "translate", "passage", "math"}
    assert conversations.request(5, pools) == conversations.request(5, pools)  # the same for every call
    assert any(follow for _, _, follow in asked) and any(turns[0]["role"] == "system" for _, turns, _ in asked)
    held = conversations.request(19, pools)[1][-1]["content"]  # a held-out wording, never a training one
    assert not any(turns[-1]["content"] == held for i, (_, turns, _) in enumerate(asked) if i != 19)
    corpus = conversations.SelfCorpus(features.expand([str(data)]), 4000)

    prefills, interrupt = [], [3]
    forward = type(model).forward_rows

    def counted(self, tokens, n_logits=None):
        if any(len(t) > 1 for t in tokens.values()):
            prefills.append(1)
            if len(prefills) == interrupt[0]:
                raise KeyboardInterrupt
        return forward(self, tokens, n_logits)

    monkeypatch.setattr(type(model), "forward_rows", counted)
    with pytest.raises(KeyboardInterrupt):
        conversations.collect(model, corpus, progress=False)
    folder = features.features_folder(model, corpus)
    assert not list(folder.glob("window-*.npz"))  # two answers were under way: nothing half-written
    prefills.clear()
    interrupt[0] = 0
    conversations.collect(model, corpus, progress=False)
    written = sorted(folder.glob("window-*.npz"))
    asked_now = len(prefills)  # the requests' prefills and the follow-ups' (each asked once)
    prefills.clear()
    conversations.collect(model, corpus, progress=False)  # all on disk: nothing is asked again
    assert prefills == []
    monkeypatch.undo()
    info = json.loads((folder / "data.json").read_text())
    assert (
        info["windows"] == len(written)
        and info["kind"].startswith("self")
        and sum(info["categories"].values()) == len(written)
    )
    row, follow_ups = model.add_rows(1)[0], 0
    for f in written:
        part = np.load(f)
        fed, labels, prompt = part["tokens"].tolist(), part["labels"].tolist(), int(part["prompt"])
        spans = part["asked"].tolist()
        assert spans[0] == [0, prompt] and len(spans) in (1, 2)
        follow_ups += len(spans) - 1
        for (_, start), after in zip(spans, [s for s, _ in spans[1:]] + [len(fed)]):
            # each answer is the target's greedy tokens (a second one follows the asked follow-up)
            assert fed[start:after] == labels[start - 1 : after - 1]
            assert after - start + 1 <= 24 or labels[after - 1] in model.tokenizer.eog_ids
        model.rollback_rows({row: 0})
        logits = model.forward_rows({row: fed}, {row: len(fed)})[row]
        assert labels == logits.argmax(-1).tolist()  # teacher forcing over it says the same
        _, hidden = model.hidden_rows([row])[row]
        np.testing.assert_allclose(part["hidden"].astype(np.float32), hidden, atol=2e-2, rtol=2e-2)
    assert follow_ups > 0  # some conversations went on to a second turn
    assert len(written) >= 5 and asked_now == len(written) + follow_ups  # every request answered once
    f = features.load_features(folder)
    assert f.n_windows == len(written)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "<|im_start|>assistant\n"
)


def test_a_small_budget_takes_the_rows_it_needs_not_a_whole_batch(tmp_path, monkeypatch):
    """A request is taken while the conversations under way, each counted as the most its answers
    can be (the finished ones' average once a batch has finished), fall short of the budget; so,
    until a batch has finished (both budgets here end before 16 conversations do), the budget is
    passed by at most one conversation. Counted as far as they had got, 16 requests were taken at
    once for a small budget and each then answered in full: `--tokens 2000` answered 6 324 tokens
    on the 1.5B, here 6 107."""
    from specdec.train import conversations

    model, data = _self_setup(tmp_path, monkeypatch)  # its answers never end: each runs to the cap
    assert model.max_rows >= conversations.ROWS == 16
    for budget in (2000, 4000):  # the second resumes from the first's conversations
        corpus = conversations.SelfCorpus(features.expand([str(data)]), budget)
        info = json.loads((conversations.collect(model, corpus, progress=False) / "data.json").read_text())
        assert budget <= info["tokens"] < budget + conversations.N_CTX


def test_the_users_own_requests_are_asked_instead_of_the_templates(tmp_path, monkeypatch):
    """`--requests FILE`: each request of the file (an OpenAI chat body as a server logs it, a
    ShareGPT conversation, a prompt; JSON Lines or one JSON list) is asked once, in the file's
    order, up to its last user turn and as the chat template renders it, with no follow-up of
    ours; an entry with nothing to answer is skipped and counted; the file's end ends the data
    before the budget does; anything malformed is one error naming its line, before answering."""
    import re

    from specdec.train import conversations

    monkeypatch.setattr(conversations, "ANSWER_TOKENS", 12)
    model, _ = _self_setup(tmp_path, monkeypatch)
    model.tokenizer.chat_template, model.is_instruct = CHATML, True
    system = {"role": "system", "content": "Be brief."}
    entries = [
        {"model": "m", "messages": [system, {"role": "user", "content": "Why is the sky blue?"}], "temperature": 0.7},
        {
            "conversations": [
                {"from": "human", "value": "Name a cat."},
                {"from": "gpt", "value": "Tom."},
                {"from": "human", "value": "Another?"},
                {"from": "gpt", "value": "Felix."},
            ]
        },
        {"prompt": "Count to three.", "category": "counting"},
        {"messages": [{"role": "assistant", "content": "Hello!"}]},  # no user turn: skipped
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "Add 2 "}, {"type": "text", "text": "and 3."}]}
            ]
        },
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in entries) + "\n\n")
    requests = conversations.read_requests(path)
    assert len(requests.chats) == 4 and requests.skipped == 1
    assert requests.request(0) == ("requests", entries[0]["messages"], None)
    assert requests.request(1)[1] == [
        {"role": "user", "content": "Name a cat."},
        {"role": "assistant", "content": "Tom."},
        {"role": "user", "content": "Another?"},
    ]  # the trailing answer dropped: the target writes its own
    assert requests.request(2)[:2] == ("counting", [{"role": "user", "content": "Count to three."}])
    assert requests.request(3)[1] == [{"role": "user", "content": "Add 2 and 3."}]
    listed = tmp_path / "requests.json"
    listed.write_text(json.dumps(entries, indent=1))
    assert conversations.read_requests(listed).chats == requests.chats

    corpus = conversations.SelfCorpus([], 100_000, requests=requests)
    folder = conversations.collect(model, corpus, progress=False)
    written = sorted(folder.glob("window-*.npz"))
    assert [f.name for f in written] == [f"window-{i:06d}.npz" for i in range(4)]  # each once; then the file ended
    tokenizer = model.tokenizer
    for index, f in enumerate(written):
        part = np.load(f)
        prompt, turns = int(part["prompt"]), requests.request(index)[1]
        rendered = tokenizer.encode(tokenizer.apply_chat_template(turns), add_special=False, special=True)
        assert part["tokens"][:prompt].tolist() == rendered
        assert part["asked"].tolist() == [[0, prompt]]  # no follow-up turn added to a real request
        assert len(part["tokens"]) - prompt + 1 == conversations.ANSWER_TOKENS  # answered to the cap
    info = json.loads((folder / "data.json").read_text())
    assert info["categories"] == {"counting": 1, "requests": 3} and info["windows"] == 4
    assert "requests.jsonl" in info["kind"] and "1 without" in info["kind"]
    assert corpus.key != conversations.SelfCorpus([], 100_000).key  # a data set of its own in the cache

    for text, fragment in [
        ("not json\n", "line 1: not JSON"),
        ('{"prompt": "hi"}\n\n[1]\n', "line 3: a request is a JSON object, not list"),
        ('{"text": "hi"}\n', "line 1: a request needs 'messages'"),
        ('{"messages": [{"role": "robot", "content": "hi"}]}\n', "unknown role 'robot'"),
        ('{"messages": [{"role": "user", "content": 3}]}\n', "its text as a string in 'content'"),
        ('{"conversations": {"from": "human"}}\n', "'conversations' must be a list"),
        ('{"prompt": [1, 2]}\n', "'prompt' must be a string"),
        ('{"messages": [{"role": "user", "content": "  "}]}\n', "holds no request with a user turn"),
        ("", "holds no request"),
        ('[{"prompt": "hi"},', "is not JSON"),
        ('[{"prompt": "hi"}, 7]', "item 2: a request is a JSON object"),
    ]:
        path.write_text(text)
        with pytest.raises(SpecdecError, match=re.escape(fragment)):
            conversations.read_requests(path)
    with pytest.raises(SpecdecError, match="with --requests there are none"):
        conversations.SelfCorpus([], 1000, invented=0.5, requests=requests)
    # an OpenAI body's roles are read as the server reads them: 'developer' is a system turn
    developer = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi."}]
    path.write_text(json.dumps({"messages": developer}) + "\n")
    assert conversations.read_requests(path).chats == ((("system", "Be brief."), ("user", "Hi.")),)


def test_specdec_train_on_a_file_of_requests(tmp_path, monkeypatch):
    """`specdec train --requests FILE` through the CLI: the file's requests answered and trained on,
    a note where they fall short of --tokens, and the file named in the head's provenance."""
    _, _ = _self_setup(tmp_path, monkeypatch)
    requests = tmp_path / "asked.jsonl"
    requests.write_text("".join(json.dumps({"prompt": f"the cat {w} in a hat"}) + "\n" for w in ("sat", "ran", "hid")))
    out = tmp_path / "r.head"
    run = subprocess.run(
        [
            sys.executable, "-m", "specdec.cli", "train", "medusa:1", "--backend", "numpy",
            "--target", str(tmp_path / "tiny.gguf"), "--requests", str(requests), "--tokens", "100000",
            "--epochs", "1", "--vocab", "200", "--out", str(out), "--no-progress",
        ],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"the 3 requests of {requests} came to" in run.stderr and "under --tokens 100000" in run.stderr
    info = headfile.read_info(out)
    assert "the requests of asked.jsonl (3 with a user turn" in info.data["kind"]
    assert info.data["windows"] == 3


def test_invented_requests_are_the_targets_own_seeded_and_asked_as_written(tmp_path, monkeypatch):
    """`--invented`: the target writes requests from its template's open user turn (Magpie). Each
    is drawn from the target's own nucleus, seeded by its index (rows change nothing), None where
    the turn never ends; the chosen share of conversations ask them as
    written, and a resumed run asks the target for none again."""
    from specdec.train import conversations

    monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(conversations, "ANSWER_TOKENS", 12)
    monkeypatch.setattr(conversations, "INVENT_TOKENS", 6)
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen2", seed=3, n_layer=2, n_ctx=2048)
    data = tmp_path / "data"
    data.mkdir()
    (data / "purr.py").write_text(SOURCE)
    model = load_numpy_model(path, n_ctx=conversations.N_CTX)
    with pytest.raises(SpecdecError, match="need a chat model"):  # a base model opens no user turn
        conversations.collect(model, conversations.SelfCorpus(features.expand([str(data)]), 600, invented=0.5))
    model.tokenizer.chat_template, model.is_instruct = CHATML, True
    tokenizer = model.tokenizer
    common = frozenset(tokenizer.encode(" e t a o", add_special=False))
    monkeypatch.setattr(tokenizer, "eog_ids", tokenizer.eog_ids | common)  # most turns end within 6 tokens

    indices = [1, 3, 5, 7, 9, 11]
    made = conversations.invent(model, indices)
    assert made == conversations.invent(model, indices) and conversations.invent(model, [5]) == {5: made[5]}
    written = [q for q in made.values() if q is not None]
    assert written and len(set(written)) > 1
    drawn = []  # every token is drawn from the target's nucleus after the open user turn
    with monkeypatch.context() as m:
        m.setattr(conversations, "sample", lambda p, rng: drawn.append(p) or sample(p, rng))
        conversations.invent(model, [5])
    opening = tokenizer.encode("<|im_start|>user\n", add_special=False, special=True)
    row = model.add_rows(1)[0]
    first = model.forward_rows({row: opening}, {row: 1})[row][-1]
    model.drop_rows([row])
    np.testing.assert_array_equal(drawn[0], logits_to_probs(first, conversations.INVENT_SAMPLING))
    assert (drawn[0] > 0).sum() < len(drawn[0])  # top-p cut the tail
    with monkeypatch.context() as m:
        m.setattr(tokenizer, "eog_ids", frozenset())
        assert set(conversations.invent(model, [1, 3]).values()) == {None}  # no turn ended: no request

    pools = conversations.read_pools(features.expand([str(data)]))
    template = [i for i in range(40) if not conversations.is_invented(i, 0.5)]
    assert len(template) == 20  # the others take the kinds in turn, as all conversations do without
    assert [conversations.request(i, pools, 0, None, 0.5)[0] for i in template] == [
        conversations.request(i, pools)[0] for i in range(20)
    ]
    corpus = conversations.SelfCorpus(features.expand([str(data)]), 600, invented=0.5)
    assert corpus.key != conversations.SelfCorpus(corpus.files, 600).key  # a data set of its own
    folder = conversations.collect(model, corpus, progress=False)
    queries = {int(i): q for i, q in json.loads((folder / conversations.INVENTED).read_text()).items()}
    assert queries and all(i % 2 == 1 for i in queries)  # every second conversation
    for f in sorted(folder.glob("window-*.npz")):
        index = int(f.stem.split("-")[1])
        category, turns, _ = conversations.request(index, pools, 0, queries.get(index), 0.5)
        if queries.get(index) is not None:
            assert category == "invented" and turns == [{"role": "user", "content": queries[index]}]
            prompt = int(np.load(f)["prompt"])
            assert np.load(f)["tokens"][:prompt].tolist() == tokenizer.encode(
                tokenizer.apply_chat_template(turns), add_special=False, special=True
            )
    info = json.loads((folder / "data.json").read_text())
    assert info["categories"].get("invented") and "Magpie" in info["invented"]
    calls = []
    monkeypatch.setattr(conversations, "invent", lambda *a, **k: calls.append(a) or {})
    conversations.collect(model, corpus, progress=False)
    assert calls == []  # all on disk, the requests too


def test_a_head_trains_where_the_torch_target_runs_and_rows_change_only_the_speed(tmp_path, monkeypatch, tokenizer):
    """`--data self` answered 1 or 3 at a time writes the same conversations (greedy: the rows
    change the speed only), and the head trains on the torch target's own device (a GPU's under
    SPECDEC_TEST_DEVICE=cuda), its file drafting as any head's."""
    from specdec.train import conversations
    from specdec.train.trainer import device_of

    from . import tiny_hf

    for name, value in (("ANSWER_TOKENS", 16), ("PROMPT_TOKENS", 300), ("N_CTX", 512)):  # the tiny models' context
        monkeypatch.setattr(conversations, name, value)
    data = tmp_path / "data"
    data.mkdir()
    (data / "cats.md").write_text(f"# Cats\n\n{PROSE}\n\n{PROSE.upper()}\n")
    (data / "purr.py").write_text(SOURCE)
    target = tiny_hf.wrap(tiny_hf.pair("qwen2", len(tokenizer))[0], tokenizer, "qwen2")
    corpus = conversations.SelfCorpus(features.expand([str(data)]), 1200)
    windows = {}
    for rows in (1, 3):
        monkeypatch.setenv("SPECDEC_HOME", str(tmp_path / f"home-{rows}"))
        folder = conversations.collect(target, corpus, progress=False, rows=rows)
        parts = [np.load(f) for f in sorted(folder.glob("window-*.npz"))]
        windows[rows] = [(p["tokens"].tolist(), p["labels"].tolist()) for p in parts]
    assert len(windows[1]) >= 5 and windows[1] == windows[3]
    assert device_of(target).split(":")[0] == tiny_hf.DEVICE.split(":")[0]
    out = tmp_path / "m.head"
    config = TrainConfig("medusa", steps=2, vocab=100, epochs=1.0, batch=16)
    info = train(target, features.load_features(folder), config, out, {"kind": "test"}, progress=False)
    assert info.training["device"] == device_of(target) and out.exists()
    loaded, tensors = headfile.load(out)
    # the blocks start at zero (the target's own head): the updates on the device moved them
    assert loaded.target_sha256 == target.identity and np.abs(tensors["medusa.0.weight"]).max() > 0


def test_answering_loads_the_target_with_a_cache_stream_a_row(monkeypatch):
    """--data self answers ROWS requests at once on a CPU (--rows another number), each row in a
    KV cache stream of its own (trees=False: a step's attention reads each row's own cells, not a
    shared pool's whole range); --data text reads one window at a time."""
    import specdec
    from specdec.cli import build_parser
    from specdec.cli import train as train_cli
    from specdec.train import conversations

    from .conftest import Stopped, captured_call

    seen = captured_call(monkeypatch, specdec, "load_model")
    for flags, rows, n_ctx in (
        ([], conversations.ROWS, conversations.N_CTX),
        (["--rows", "3"], 3, conversations.N_CTX),
        (["--data", "text"], 1, features.WINDOW),
    ):
        args = build_parser().parse_args(["train", "medusa:2", "--out", "x.head", *flags])
        with pytest.raises(Stopped):
            train_cli.cmd_train(args)
        assert (seen["max_rows"], seen["n_ctx"], seen["trees"]) == (rows, n_ctx, False), flags


def test_train_loads_a_torch_target_static_with_graphs_on_a_gpu_and_dynamic_elsewhere(monkeypatch):
    """--cache auto (train's default): the layout the GPU answers fastest in, the static cache
    with CUDA graphs, on a CUDA device; the dynamic cache on a CPU; what is asked, when asked.
    The chosen layout, and the device flags, reach load_model."""
    import specdec
    from specdec.cli import build_parser
    from specdec.cli import train as train_cli
    from specdec.models import transformers

    from .conftest import Stopped, captured_call

    seen = captured_call(monkeypatch, specdec, "load_model")
    for device, flags, layout in (
        ("cuda", [], ("static", True)),
        ("cpu", [], ("dynamic", False)),
        ("cuda", ["--cache", "dynamic"], ("dynamic", False)),
        ("cpu", ["--cache", "static"], ("static", False)),
    ):
        monkeypatch.setattr(transformers, "pick_device", lambda name, device=device: device)
        args = build_parser().parse_args(["train", "medusa:2", "--backend", "torch", "--out", "x.head", *flags])
        with pytest.raises(Stopped):
            train_cli.cmd_train(args)
        assert (seen["cache"], seen["graphs"], seen["device"]) == (*layout, "auto"), (device, flags)
    args = build_parser().parse_args(["train", "medusa:2", "--backend", "torch", "--graphs", "--out", "x.head"])
    with pytest.raises(SpecdecError, match="--graphs needs a CUDA device"):  # on the CPU
        train_cli.cmd_train(args)
