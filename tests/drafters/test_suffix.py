"""The suffix cache across requests: its index, its choice, its memory cap, its file, and that
drafting from it changes nothing in greedy output."""

from __future__ import annotations

import os

import numpy as np
import pytest

from specdec import SpeculativeDecoder
from specdec.build import make_drafter
from specdec.costs import CostTable
from specdec.drafters import new_suffix_cache
from specdec.drafters.ngram import NgramDrafter
from specdec.drafters.suffix import DEPTH, EVICT_TO, FORMAT, SuffixCacheDrafter, tokenizer_fingerprint
from specdec.errors import SpecdecError
from specdec.sampling import SamplingParams
from specdec.spec import parse, parse_method

from ..toy import ToyLM, on_virtual_clock

PARAMS = SamplingParams()
RNG = np.random.default_rng(0)


def propose(cache: SuffixCacheDrafter, context, k=8, row=0):
    cache.begin(row, context, PARAMS, RNG)
    draft = cache.propose({row: list(context)}, {row: k})[row]
    cache._rows.pop(row)  # a probe, not a request: it must not join the cache
    return draft


def test_the_longest_match_wins_over_a_short_one():
    cache = SuffixCacheDrafter()
    cache.add([9, 3, 4, 70, 71])  # ends in ... 3 4 -> 70: a 2-token match
    cache.add([1, 2, 3, 4, 50, 51, 52])  # ends in 1 2 3 4 -> 50: a 4-token match, older
    cache.add([8, 4, 60, 61])  # 4 -> 60: a 1-token match, newest
    draft = propose(cache, [7, 1, 2, 3, 4])
    assert draft.tokens == [50, 51, 52]
    assert draft.evidence == {"match": 4, "votes": (1, 1)}


def test_the_most_frequent_continuation_is_chosen_at_every_position():
    cache = SuffixCacheDrafter()
    for tail in ([10, 20], [11, 21], [11, 22], [11, 22], [10, 20]):
        cache.add([1, 2, 3, *tail])
    draft = propose(cache, [5, 1, 2, 3], k=4)
    # after 1 2 3: 11 three times, 10 twice; after 1 2 3 11: 22 twice, 21 once
    assert draft.tokens == [11, 22]
    assert draft.evidence == {"match": 3, "votes": (3, 5)}


def test_a_draft_reaches_no_further_than_its_match_nor_past_a_split():
    cache = SuffixCacheDrafter()
    cache.add([1, 2, 3, 4, 5, 6, 7, 8])
    assert propose(cache, [9, 2]).tokens == [3]  # a 1-token match: 1 token
    assert propose(cache, [9, 2, 3, 4]).tokens == [5, 6, 7]  # 3 tokens: 3
    for tail in range(20, 32):  # 12 requests part after 1 2 3 4 5
        cache.add([1, 2, 3, 4, 5, tail, 99])
    # 5 is certain, then 1 in 13 agrees: below MIN_SHARE, the chain stops before the split
    assert propose(cache, [1, 2, 3, 4]).tokens == [5]


def test_a_tie_goes_to_the_most_recent():
    cache = SuffixCacheDrafter()
    cache.add([1, 2, 30])
    cache.add([1, 2, 40])
    assert propose(cache, [1, 2], k=1).tokens == [40]


def test_matches_and_continuations_stop_at_a_sequence_boundary():
    cache = SuffixCacheDrafter()
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    assert propose(cache, [2, 3]).tokens == []  # 2 3 ends its sequence: nothing follows
    draft = propose(cache, [1, 2])
    assert draft.tokens == [3] and draft.evidence["match"] == 2  # 3 is last: the chain stops there


def test_the_match_is_measured_up_to_the_depth_only():
    seq = list(range(100, 100 + 2 * DEPTH))
    cache = SuffixCacheDrafter()
    cache.add(seq + [7, 8])
    draft = propose(cache, seq, k=2)
    assert draft.tokens == [7, 8] and draft.evidence["match"] == DEPTH


def test_with_an_empty_cache_it_is_prompt_lookup_over_the_live_context():
    cache = SuffixCacheDrafter()
    context = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    draft = propose(cache, context, k=3)
    assert draft.tokens == [4, 5, 9] and draft.evidence["match"] == 3
    assert NgramDrafter().propose({0: context}, {0: 3})[0].tokens == draft.tokens


def test_a_finished_row_joins_the_cache_with_every_token_it_emitted():
    cache = SuffixCacheDrafter()
    context = [1, 2, 3]
    cache.begin(0, context, PARAMS, RNG)
    cache.propose({0: context}, {0: 4})
    context += [4, 5, 6]  # the engine's live list grows after the last proposal
    cache.end([0])
    assert cache.tokens_stored == 6
    assert propose(cache, [9, 3, 4], row=1).tokens == [5, 6]


def test_eviction_keeps_the_store_under_the_cap_and_forgets_the_oldest_first():
    cache = SuffixCacheDrafter(cap=100)
    cache.add([500, 501, 502, 503], static=True)  # the corpus is never forgotten
    for i in range(40):
        cache.add([i, 1000 + i, 2000 + i])
        assert cache.tokens_stored <= 100
    assert cache.tokens_stored >= int(EVICT_TO * 100) - 3  # evicts down to EVICT_TO, not further
    assert propose(cache, [0]).tokens == []  # the oldest request is gone
    assert propose(cache, [39]).tokens == [1039]  # the newest is there
    assert propose(cache, [500, 501]).tokens == [502, 503]  # so is the corpus
    # the index was rebuilt from what is kept: nothing points past the store
    assert all(
        p <= len(cache._store.tokens) for v in cache._store.index.values() for p in ([v] if isinstance(v, int) else v)
    )


def test_a_sequence_longer_than_the_cap_keeps_its_end_and_a_corpus_too_big_is_refused():
    cache = SuffixCacheDrafter(cap=50)
    cache.add(list(range(1000, 1200)))
    assert 0 < cache.tokens_stored <= 50
    assert propose(cache, [1196, 1197]).tokens == [1198, 1199]
    with pytest.raises(SpecdecError, match="--suffix-cap"):
        SuffixCacheDrafter(cap=10).add(list(range(11)), static=True)


def test_save_and_load_round_trip(tmp_path):
    target = ToyLM(vocab_size=32, seed=1)
    a = new_suffix_cache(target)
    a.add([1, 2, 3, 4, 5])
    a.add([1, 2, 3, 9])
    a.add([7, 7, 7], static=True)  # the corpus comes from its own file: not saved
    path = tmp_path / "cache.npz"
    a.save(path)
    assert [p.name for p in tmp_path.iterdir()] == ["cache.npz"]  # no temporary file left behind
    b = new_suffix_cache(target)
    assert b.load(path) == 9 and b.tokens_stored == 9
    for context in ([1, 2, 3], [2, 3], [4], [0, 1]):
        assert propose(a, context) == propose(b, context)
    assert new_suffix_cache(target).load(tmp_path / "missing.npz") == 0  # the first run creates it


def test_a_save_replaces_the_old_file_whole(tmp_path):
    path = tmp_path / "cache.npz"
    cache = SuffixCacheDrafter()
    cache.add([1, 2, 3])
    cache.save(path)
    cache.add([4, 5, 6])
    cache.save(path)
    again = SuffixCacheDrafter()
    again.load(path)
    assert again.tokens_stored == 6


@pytest.mark.parametrize("content", [b"", b"not a cache at all", b"PK\x03\x04 truncated zip"])
def test_a_corrupt_cache_file_is_a_user_error(tmp_path, content):
    path = tmp_path / "cache.npz"
    path.write_bytes(content)
    with pytest.raises(SpecdecError, match="not a specdec suffix cache or is damaged"):
        SuffixCacheDrafter().load(path)


def test_a_truncated_cache_file_is_a_user_error(tmp_path):
    path = tmp_path / "cache.npz"
    cache = SuffixCacheDrafter()
    cache.add(list(range(5000)))
    cache.save(path)
    path.write_bytes(path.read_bytes()[: os.path.getsize(path) // 2])
    with pytest.raises(SpecdecError, match="damaged"):
        SuffixCacheDrafter().load(path)


def _write_cache(path, header: str, lengths, tokens, **extra) -> None:
    """A cache file as save writes one, with whatever structure the test gives it."""
    with open(path, "wb") as f:
        np.savez_compressed(
            f,
            header=np.frombuffer(header.encode(), dtype=np.uint8),
            lengths=np.asarray(lengths, dtype=np.int64),
            tokens=np.asarray(tokens, dtype=np.int64),
            **extra,
        )


@pytest.mark.parametrize(
    "header, lengths, tokens",
    [
        ("specdec-suffix-cache/0\n", [3], [1, 2, 3]),  # another format's header
        ("", [3], [1, 2, 3]),  # no header at all
        (f"{FORMAT}\n", [2, 2], [1, 2, 3]),  # lengths that overrun the tokens
        (f"{FORMAT}\n", [1], [1, 2, 3]),  # tokens no length covers
        (f"{FORMAT}\n", [4, -1], [1, 2, 3]),  # a negative length that adds up
        (f"{FORMAT}\n", [[3]], [1, 2, 3]),  # lengths of the wrong shape
        (f"{FORMAT}\n", [3], [[1, 2, 3]]),  # tokens of the wrong shape
    ],
    ids=["old-format", "no-header", "overrun", "uncovered", "negative-length", "2-d-lengths", "2-d-tokens"],
)
def test_a_cache_file_of_the_wrong_structure_is_a_user_error(tmp_path, header, lengths, tokens):
    path = tmp_path / "cache.npz"
    _write_cache(path, header, lengths, tokens)
    cache = SuffixCacheDrafter()
    with pytest.raises(SpecdecError, match="not a specdec suffix cache or is damaged"):
        cache.load(path)
    assert cache.tokens_stored == 0  # nothing of it was added


def test_a_cache_file_without_its_arrays_is_a_user_error(tmp_path):
    path = tmp_path / "cache.npz"
    with open(path, "wb") as f:
        np.savez_compressed(f, header=np.frombuffer(f"{FORMAT}\n".encode(), dtype=np.uint8))
    with pytest.raises(SpecdecError, match="not a specdec suffix cache or is damaged"):
        SuffixCacheDrafter().load(path)
    _write_cache(path, f"{FORMAT}\n", [2, 1], [1, 2, 3])  # the same, whole: it loads
    assert SuffixCacheDrafter().load(path) == 3


def test_a_cache_of_another_tokenizer_is_refused(tmp_path):
    path = tmp_path / "cache.npz"
    a = new_suffix_cache(ToyLM(vocab_size=32, seed=1))
    a.add([1, 2, 3])
    a.save(path)
    other = new_suffix_cache(ToyLM(vocab_size=40, seed=1))
    with pytest.raises(SpecdecError, match="another tokenizer"):
        other.load(path)
    assert tokenizer_fingerprint(ToyLM(32).tokenizer, 32) == a.fingerprint


def test_the_grammar_names_it():
    assert parse("suffix").kind == "suffix"
    target = ToyLM(vocab_size=32)
    assert isinstance(make_drafter("suffix", target), SuffixCacheDrafter)
    mine = SuffixCacheDrafter()
    assert make_drafter("suffix", target, suffix=mine) is mine
    # the cache given drafts the spec's shape: --draft suffix --draft-width 2 --draft-nodes 6
    assert make_drafter(parse("suffix", width=2, nodes=6), target, suffix=mine) is mine
    assert (mine.width, mine.nodes) == (2, 6)
    make_drafter(parse("suffix"), target, suffix=mine)
    assert (mine.width, mine.nodes) == (1, 0)


# -- trees: where earlier continuations parted, both sides --------------------------------------------


def parted_cache(width=2, nodes=0) -> SuffixCacheDrafter:
    """After 1 2 3: 10 11 12 twice, 20 21 22 once, 30 31 32 once (the oldest)."""
    cache = SuffixCacheDrafter(width=width, nodes=nodes)
    for tail in ([30, 31, 32], [10, 11, 12], [20, 21, 22], [10, 11, 12]):
        cache.add([1, 2, 3, *tail])
    return cache


def test_a_tree_keeps_the_continuations_earlier_answers_parted_into():
    draft = propose(parted_cache(width=2), [5, 1, 2, 3], k=3)
    # best first by the share agreeing with the whole path: 10 11 12 (2 of 4), then 20 21 22
    # (1 of 4, the more recent of the two singles); 30 is the third child of the root: width 2
    assert draft.tokens == [10, 11, 12, 20, 21, 22]
    assert draft.parents == [-1, 0, 1, -1, 3, 4]
    assert draft.evidence == {"match": 3, "votes": (2, 4)}
    wide = propose(parted_cache(width=3), [5, 1, 2, 3], k=3)
    # k x width = 9 nodes; paths of equal share in the order they were found (30 before 21)
    assert wide.tokens == [10, 11, 12, 20, 30, 21, 31, 22, 32]
    assert wide.parents == [-1, 0, 1, -1, -1, 3, 4, 5, 6]


def test_a_tree_stops_at_its_node_budget_and_one_that_never_branched_is_a_chain():
    three = propose(parted_cache(width=2, nodes=3), [5, 1, 2, 3], k=3)
    assert three.tokens == [10, 11, 12] and three.parents is None  # the majority's chain alone
    four = propose(parted_cache(width=2, nodes=4), [5, 1, 2, 3], k=3)
    assert four.tokens == [10, 11, 12, 20] and four.parents == [-1, 0, 1, -1]


def test_a_tree_reaches_no_further_than_its_match_nor_below_min_share():
    cache = parted_cache(width=2)
    short = propose(cache, [5, 9, 3], k=3)  # a 1-token match: 1 deep, two roots
    assert short.tokens == [10, 20] and short.parents == [-1, -1]
    for tail in range(40, 52):  # 12 more answers part after 1 2 3 10
        cache.add([1, 2, 3, 10, tail])
    draft = propose(cache, [5, 1, 2, 3], k=3)
    # 10 now holds 14 of 16; below it 11 holds 2 of 14 (share 1/8) and each new tail 1 of 14
    # (1/16, under MIN_SHARE); 20 and 30 hold 1/16 each
    assert draft.tokens == [10, 11, 12] and draft.parents is None


def test_a_trees_first_branch_is_the_chain():
    rng = np.random.default_rng(5)
    cache = SuffixCacheDrafter()
    for _ in range(40):
        cache.add(rng.integers(0, 6, rng.integers(3, 30)).tolist())
    for _ in range(200):
        context = rng.integers(0, 6, rng.integers(1, 12)).tolist()
        k = int(rng.integers(1, 10))
        cache.begin(0, context, PARAMS, RNG)
        state = cache._rows.pop(0)
        chain = cache.propose_one(state, context, k)
        cache.shape(2, nodes=10_000)  # no budget to run out of: every node at MIN_SHARE or above
        tree = cache.propose_one(state, context, k)
        cache.shape(1)
        assert tree.evidence == chain.evidence
        # the tree's first branch (each node's first child) is the chain; a tree that kept no
        # second branch goes as the chain itself
        assert tree.first_branch().tokens == chain.tokens


def test_a_suffix_tree_writes_plain_greedy_and_drafts_the_branch_the_target_takes():
    """The cache holds a wrong answer twice and the target's own once after each prompt: the chain
    drafts the majority's and loses its first step; the tree drafts both, and the target takes
    the second branch. Afterwards the right answer's longer match leads both."""
    target = ToyLM(vocab_size=32, seed=1)
    plain = [SpeculativeDecoder(target, None).generate(p, max_new_tokens=30).tokens for p in PROMPTS]
    runs = {}
    for method in ("suffix:6", "suffix:6x2"):
        cache = SuffixCacheDrafter()
        for prompt, right in zip(PROMPTS, plain):
            wrong = [(t + 1) % 32 for t in right]
            for tail in (wrong, right, wrong):  # the majority is wrong, the most recent too
                cache.add([*prompt, *tail])
        decoder = SpeculativeDecoder.from_spec(target, parse_method(method), suffix=cache)
        if method == "suffix:6x2":
            for prompt, right in zip(PROMPTS, plain):
                first = propose(cache, prompt, k=6)
                assert first.parents is not None and first.first_branch().tokens == [(t + 1) % 32 for t in right[:6]]
                second = first.parents.index(-1, 1)  # the second root: the right answer's branch
                assert first.tokens[second : second + 6] == right[:6]
        runs[method] = [decoder.generate(p, max_new_tokens=30) for p in PROMPTS]
        assert [r.tokens for r in runs[method]] == plain, method
    assert sum(r.stats.steps for r in runs["suffix:6x2"]) < sum(r.stats.steps for r in runs["suffix:6"])


# -- in the engine: greedy output unchanged --------------------------------------------------------

PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, [4, 12, 4, 13] * 5, [1, 2, 3, 4, 5, 6, 7]]


def test_greedy_output_equals_plain_and_a_repeat_is_drafted_whole():
    target = ToyLM(vocab_size=32, seed=1)
    plain = [SpeculativeDecoder(target, None).generate(p, max_new_tokens=40).tokens for p in PROMPTS]
    decoder = SpeculativeDecoder(target, "suffix", k=4)
    first = [decoder.generate(p, max_new_tokens=40) for p in PROMPTS]
    second = [decoder.generate(p, max_new_tokens=40) for p in PROMPTS]
    assert [r.tokens for r in first] == plain and [r.tokens for r in second] == plain
    # asked again, every draft is the earlier answer: all accepted
    assert all(r.stats.accepted == r.stats.drafted > 0 for r in second)
    assert sum(r.stats.accepted for r in second) > sum(r.stats.accepted for r in first)


def test_a_batch_shares_one_cache_and_equals_plain():
    target = ToyLM(vocab_size=32, seed=2)
    plain = [SpeculativeDecoder(target, None).generate(p, max_new_tokens=30).tokens for p in PROMPTS]
    decoder = SpeculativeDecoder(target, "suffix", k=3)
    assert [r.tokens for r in decoder.generate_batch(PROMPTS, max_new_tokens=30)] == plain
    assert decoder.drafter.tokens_stored == sum(len(p) + 30 for p in PROMPTS)
    again = decoder.generate_batch(PROMPTS, max_new_tokens=30)
    assert [r.tokens for r in again] == plain and all(r.stats.accepted == r.stats.drafted for r in again)


def test_auto_takes_the_suffix_cache_where_it_promises_more():
    """Toy target, a flat cost curve: a repeated request is drafted from the suffix cache (its
    match reaches across the whole prompt; prompt lookup's does not), losslessly."""
    target = ToyLM(vocab_size=32, seed=1)
    target.path = None
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    plain = SpeculativeDecoder(target, None).generate(prompt, max_new_tokens=40).tokens
    flat = CostTable({w: 0.01 for w in range(1, 17)})
    auto = SpeculativeDecoder(target, "auto", suffix=True, costs=(flat, None))
    auto.engine.clock = on_virtual_clock(target, flat.measured)  # what it learns live is the curve
    assert auto.generate(prompt, max_new_tokens=40).tokens == plain
    again = auto.generate(prompt, max_new_tokens=40)
    assert again.tokens == plain
    assert any(key.startswith("suffix:") for key in again.stats.decisions), again.stats.decisions
    assert again.stats.steps < 20


def test_auto_without_the_suffix_cache():
    target = ToyLM(vocab_size=32)
    assert SpeculativeDecoder(target, "auto", suffix=False).free_drafters()[0].name == "ngram"
    assert [d.name for d in SpeculativeDecoder(target, "auto", suffix=False).free_drafters()] == ["ngram"]
    assert [d.name for d in SpeculativeDecoder(target, "auto", suffix=True).free_drafters()] == ["ngram", "suffix"]


@pytest.mark.real_models
def test_greedy_equals_plain_on_the_real_target(target_model):
    """The 1.5B target, one prompt asked twice through the suffix cache: both runs are the
    target's greedy output (under the rounding-tie rule of tests/lossless.py), and the
    second is drafted from the first."""
    from specdec import GenerationConfig

    from ..lossless import assert_greedy_lossless

    prompt = "Add type hints to this function:\n\ndef scale(values, factor):\n    return [v * factor for v in values]\n"
    config = GenerationConfig(max_new_tokens=48)
    plain = SpeculativeDecoder(target_model, None).generate(prompt, config)
    decoder = SpeculativeDecoder(target_model, "suffix", k=8)
    for _ in range(2):
        result = decoder.generate(prompt, config)
        assert_greedy_lossless(target_model, plain.prompt_tokens, plain.tokens, result.tokens)
    assert result.stats.accepted >= 0.8 * result.stats.drafted > 0


@pytest.mark.parametrize("tokens", [[1, 2, 32], [1, -2, 3], [1, 2, 10**9]], ids=["vocab-size", "negative", "huge"])
def test_a_cache_file_of_ids_outside_the_vocabulary_is_a_user_error(tmp_path, tokens):
    """A valid header and this tokenizer's fingerprint, but ids the target has not: refused when
    loaded (before, generate printed part of its answer and died in llama_decode)."""
    target = ToyLM(vocab_size=32, seed=1)
    path = tmp_path / "cache.npz"
    _write_cache(path, f"{FORMAT}\n{new_suffix_cache(target).fingerprint}", [3], tokens)
    cache = new_suffix_cache(target)
    with pytest.raises(SpecdecError, match="outside the vocabulary"):
        cache.load(path)
    assert cache.tokens_stored == 0


def test_a_cache_file_of_damaged_compressed_data_is_a_user_error(tmp_path):
    """The zip's structure is whole but its deflated data is not (zlib.error, once a traceback)."""
    path = tmp_path / "cache.npz"
    cache = SuffixCacheDrafter()
    cache.add([int(t) for t in np.random.default_rng(0).integers(0, 1000, 20_000)])
    cache.save(path)
    data = bytearray(path.read_bytes())
    header = data.index(b"PK\x03\x04", data.index(b"lengths.npy"))  # the tokens member's local header
    name, extra = (
        int.from_bytes(data[header + 26 : header + 28], "little"),
        int.from_bytes(data[header + 28 : header + 30], "little"),
    )
    data[header + 30 + name + extra] = 0xFF  # its first deflate block: a block type that does not exist
    path.write_bytes(bytes(data))
    with pytest.raises(SpecdecError, match="damaged"):
        SuffixCacheDrafter().load(path)
