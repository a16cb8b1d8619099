"""DraftSpec: one parser for every caller (CLI flags, bench methods, a request's policy) and one
factory, on toy models."""

from __future__ import annotations

import pytest

from specdec import SpeculativeDecoder
from specdec.build import make_drafter, pool
from specdec.drafters.cross_vocab import CrossVocabDrafter
from specdec.drafters.early_exit import EarlyExitDrafter
from specdec.drafters.model import ModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import SuffixCacheDrafter
from specdec.errors import SpecdecError
from specdec.spec import AUTO_SUFFIX, DEFAULT_K, KINDS, DraftSpec, parse, parse_method

from .drafters.test_cross_vocab import draft_lm, target_lm
from .toy import ToyLM


@pytest.mark.parametrize(
    "text, spec",
    [
        ("", DraftSpec("none", k=0)),
        ("none", DraftSpec("none", k=0)),
        (" ngram ", DraftSpec("ngram")),
        ("suffix", DraftSpec("suffix")),
        ("auto", DraftSpec("auto", k=0)),
        ("early-exit:3", DraftSpec("early-exit", layers=3)),
        ("qwen2.5-coder-0.5b", DraftSpec("model", model="qwen2.5-coder-0.5b")),
        ("string:gemma-3-270m", DraftSpec("model", model="gemma-3-270m", vocab="string")),
        ("intersect:/models/x.gguf", DraftSpec("model", model="/models/x.gguf", vocab="intersect")),
    ],
)
def test_every_kind_parses_to_one_spec(text, spec):
    assert parse(text) == spec and spec.kind in KINDS


def test_k_and_auto_s_draft_model_are_part_of_the_spec():
    assert parse("ngram", k=8) == DraftSpec("ngram", k=8)
    assert parse("auto", draft_model="qwen2.5-coder-0.5b") == DraftSpec("auto", k=0, model="qwen2.5-coder-0.5b")
    assert parse("auto", draft_model="intersect:gemma-3-270m") == DraftSpec(
        "auto", k=0, model="gemma-3-270m", vocab="intersect"
    )
    assert parse("auto", draft_model="none") == parse("auto") == DraftSpec("auto", k=0)
    assert parse("ngram", draft_model="qwen2.5-coder-0.5b") == DraftSpec("ngram")  # for auto only
    assert DEFAULT_K == DraftSpec("ngram").k == 4


@pytest.mark.parametrize(
    "text, backend, message",
    [
        ("early-exit", None, "early-exit:L"),
        ("early-exit:x", None, "early-exit:L"),
        ("early-exit:0", None, "L must be >= 1"),
        ("early-exit:+2", None, "early-exit:L"),
        ("early-exit:1_2", None, "early-exit:L"),
        ("early-exit:2", "llama", "needs --backend numpy"),
        ("intersect:", None, "intersect:MODEL"),
        ("string: ", None, "string:MODEL"),
    ],
)
def test_a_bad_name_is_a_user_error(text, backend, message):
    with pytest.raises(SpecdecError, match=message):
        parse(text, backend)


def test_auto_s_draft_model_must_be_a_model():
    with pytest.raises(SpecdecError, match="--draft-model ngram: give a model name"):
        parse("auto", draft_model="ngram")


@pytest.mark.parametrize(
    "method, spec",
    [
        ("plain", DraftSpec("none", k=0)),
        ("auto", DraftSpec("auto", k=0)),
        ("auto:suffix", DraftSpec("auto", k=0, suffix=True)),
        ("auto:nosuffix", DraftSpec("auto", k=0, suffix=False)),
        ("draft:6", DraftSpec("model", k=6)),
        ("draft:4x2", DraftSpec("model", k=4, width=2)),
        ("draft:8x2/8", DraftSpec("model", k=8, width=2, nodes=8)),
        ("ngram:8", DraftSpec("ngram", k=8)),
        ("ngram:8x3", DraftSpec("ngram", k=8, width=3)),
        ("suffix:16", DraftSpec("suffix", k=16)),
        ("suffix:8x2", DraftSpec("suffix", k=8, width=2)),
        ("suffix:16x3/16", DraftSpec("suffix", k=16, width=3, nodes=16)),
        ("early-exit:2:3", DraftSpec("early-exit", k=3, layers=2)),
        ("early-exit:2:4x2", DraftSpec("early-exit", k=4, layers=2, width=2)),
        ("early-exit:2:4x3/5", DraftSpec("early-exit", k=4, layers=2, width=3, nodes=5)),
    ],
)
def test_bench_methods_parse_to_the_same_specs(method, spec):
    assert parse_method(method) == spec


@pytest.mark.parametrize(
    "method",
    [
        *("ngram", "ngram:0", "auto:ngram", "draft:x", "draft:4x", "draft:4x0", "draft:0x2", "early-exit:1", "gemma:4"),
        *("draft:4x2/", "draft:4x2/0", "draft:4x1/3", "draft:4x2/x"),
        *("suffix:0x2", "suffix:4x0", "suffix:4x1/3", "ngram:4x2/3", "ngram:4x0"),
        *("early-exit:0:4x2", "early-exit:2:4x1/3", "early-exit:2:x2"),
        # counts are ASCII digits: int() alone took these, so draft:1_0x2 drafted 10 deep
        *("draft:1_0x2", "draft:+3x2", "draft:3x2/+4", "ngram:\u0663x2", "draft:\u0663", "early-exit:1_2:3"),
    ],
)
def test_what_is_not_one_of_our_methods_is_none(method):
    assert parse_method(method) is None


def test_labels_and_the_suffix_rule():
    assert [DraftSpec(k, k=0 if k in ("auto", "none") else 3).label for k in ("auto", "none", "ngram", "model")] == [
        "auto",
        "none",
        "ngram:3",
        "model:3",
    ]
    assert DraftSpec("suffix").wants_suffix and not DraftSpec("ngram").wants_suffix
    assert DraftSpec("auto").wants_suffix == AUTO_SUFFIX
    assert DraftSpec("auto", suffix=False).wants_suffix is False and DraftSpec("auto", suffix=True).wants_suffix
    assert not DraftSpec("ngram", k=0).drafts and DraftSpec("auto", k=0).drafts and not DraftSpec("none").drafts


def test_one_factory_makes_every_drafter():
    target = target_lm()
    same = ToyLM(vocab_size=target.vocab_size, seed=5, noise_from=target, noise=0.5)
    same.tokenizer, same.name = target.tokenizer, "same"
    loaded = {"same": same, "other": draft_lm()}
    assert make_drafter(parse("none"), target) is None
    assert isinstance(make_drafter(parse("ngram"), target), NgramDrafter)
    assert isinstance(make_drafter(parse("suffix"), target), SuffixCacheDrafter)
    mine = SuffixCacheDrafter()
    assert make_drafter(parse("suffix"), target, suffix=mine) is mine
    assert isinstance(make_drafter(parse("same"), target, loaded.get), ModelDrafter)
    tree = make_drafter(DraftSpec("model", model="same", width=3), target, loaded.get)
    assert isinstance(tree, ModelDrafter) and tree.width == 3 and tree.name == "draft:samex3"
    given = make_drafter(DraftSpec("model", width=2), target, draft=make_drafter(parse("same"), target, loaded.get))
    assert isinstance(given, ModelDrafter) and given.width == 2 and given.model is same  # bench's draft:KxW
    shaped = make_drafter(parse_method("draft:4x2/4"), target, draft=given)  # bench's draft:KxW/N
    assert (shaped.width, shaped.nodes, shaped.model, shaped.name) == (2, 4, same, "draft:samex2/4")
    assert make_drafter(parse("same", width=3, nodes=5), target, loaded.get).nodes == 5  # --draft-nodes
    with pytest.raises(SpecdecError, match="needs a draft model of the target's vocabulary"):
        make_drafter(DraftSpec("model", width=2), target, draft=make_drafter(parse("other"), target, loaded.get))
    _, _, chain = pool(target, tree)  # auto prices chains: it drafts them from the same model
    assert isinstance(chain, ModelDrafter) and chain.width == 1 and chain.model is same
    with pytest.raises(SpecdecError, match="needs a draft model of the target's vocabulary"):
        make_drafter(DraftSpec("model", model="other", width=2), target, loaded.get)
    other = make_drafter(parse("other"), target, loaded.get)
    assert isinstance(other, CrossVocabDrafter) and other.mode == "string"
    assert make_drafter(parse("intersect:other"), target, loaded.get).mode == "intersect"
    assert make_drafter(DraftSpec("model"), target, draft=mine) is mine  # the caller's drafter
    with pytest.raises(SpecdecError, match="no loader"):
        make_drafter(parse("same"), target)
    with pytest.raises(SpecdecError, match="is a policy"):
        make_drafter(parse("auto"), target)
    with pytest.raises(SpecdecError, match="early-exit drafting needs a target on the NumPy or torch backend"):
        make_drafter(parse("early-exit:1"), target)


def test_from_spec_builds_the_decoder_a_spec_names():
    target = target_lm()
    same = ToyLM(vocab_size=target.vocab_size, seed=5, noise_from=target, noise=0.5)
    same.tokenizer, same.name = target.tokenizer, "same"
    auto = SpeculativeDecoder.from_spec(target, parse("auto", draft_model="same"), {"same": same}.get)
    assert (
        auto.auto and auto.model_drafter.model is same and [d.name for d in auto.free_drafters()] == ["ngram", "suffix"]
    )
    assert SpeculativeDecoder.from_spec(target, parse_method("auto:nosuffix")).free_drafters()[-1].name == "ngram"
    plain = SpeculativeDecoder.from_spec(target, parse("ngram", k=0))
    assert plain.drafter is None and not plain.auto
    fixed = SpeculativeDecoder.from_spec(target, parse_method("draft:3"), draft=same)
    assert isinstance(fixed.drafter, ModelDrafter) and fixed.k == 3
    assert isinstance(SpeculativeDecoder(target, "ngram", k=5).drafter, NgramDrafter)
    with pytest.raises(SpecdecError, match="unknown drafter"):
        SpeculativeDecoder(target, 3.5)


def test_early_exit_from_a_spec_on_the_numpy_backend(tmp_path):
    from specdec.models.numpy_ref import load_numpy_model

    from .models.test_numpy_ref import write_tiny_gguf

    write_tiny_gguf(tmp_path / "tiny.gguf", "gpt2", n_layer=2)
    target = load_numpy_model(tmp_path / "tiny.gguf")
    decoder = SpeculativeDecoder.from_spec(target, parse_method("early-exit:1:2"))
    assert isinstance(decoder.drafter, EarlyExitDrafter) and decoder.drafter.n_layers == 1 and decoder.k == 2
    tree = SpeculativeDecoder.from_spec(target, parse("early-exit:1", k=3, width=2, nodes=3)).drafter
    assert (tree.width, tree.nodes, tree.name) == (2, 3, "early-exit:1x2/3")
    assert SpeculativeDecoder.from_spec(target, parse_method("early-exit:1:3x2")).drafter.width == 2


def test_every_head_drafts_trees(tmp_path):
    """--draft-width / --draft-nodes and head:KxW[/N]:FILE give any head file a tree shape (an
    early-exit head drafts it as a draft model, a Medusa or prophet head from its own heads)."""
    from specdec.drafters import headfile

    files = {}
    for kind in ("early-exit", "medusa", "prophet"):
        files[kind] = tmp_path / f"{kind}.head"
        headfile.save(files[kind], headfile.HeadInfo(kind, "0" * 64, "t", 8, 32, 3, layers=1, blocks=1), {})
    tree = parse(f"head:{files['early-exit']}", width=2, nodes=3)
    assert (tree.kind, tree.width, tree.nodes) == ("head", 2, 3)
    method = parse_method(f"head:4x2/3:{files['early-exit']}")
    assert (method.k, method.width, method.nodes) == (4, 2, 3)
    assert parse_method(f"head:4:{files['medusa']}").width == 1
    for kind in ("medusa", "prophet"):
        tree = parse(f"head:{files[kind]}", width=3)
        assert (tree.kind, tree.width, tree.nodes) == ("head", 3, 0)
        method = parse_method(f"head:3x2/5:{files[kind]}")
        assert (method.k, method.width, method.nodes) == (3, 2, 5)
