"""Engine(prefix_cache=True): a finished row keeps its cache, and a prompt that starts the same way
takes it and reads only the rest. Outputs stay those of a fresh row; rows held never exceed max_rows."""

from __future__ import annotations

import pytest

from specdec import GenerationConfig, SpeculativeDecoder
from specdec.controller import FixedController
from specdec.engine import Engine

from .test_engine import CountedRows
from .toy import ToyLM

PROMPT = [(i * 7) % 31 + 1 for i in range(40)]
OTHER = [(i * 5) % 29 + 2 for i in range(30)]


@pytest.fixture
def target():
    return ToyLM(vocab_size=32, seed=1)


def solo(prompt, n):
    return SpeculativeDecoder(ToyLM(vocab_size=32, seed=1), None, 0).generate(prompt, max_new_tokens=n).tokens


def cached_engine(target, **kw):
    return Engine(target, FixedController(None, 0), prefix_cache=True, **kw)


def next_turn(engine, target, first):
    """A conversation's next turn after request `first`: it finds all of first's context in a
    cache but the answer's last token, reads only the rest in its first forward, and answers as
    a fresh model does."""
    turn = first.context + [3, 4, 5, 6]  # the answer, then the user's next message
    counted = CountedRows(target)
    second = engine.add(turn, GenerationConfig(max_new_tokens=10))
    engine.run([second])
    assert second.stats.cached_tokens == len(first.context) - 1
    assert list(counted.calls[0].values()) == [(len(turn) - 1 - second.stats.cached_tokens, False)]
    assert second.result.tokens == solo(turn, 10)
    return second


def test_a_repeated_prompt_reads_only_its_last_token(target):
    engine = cached_engine(target, max_rows=1)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=12))
    engine.run([first])
    counted = CountedRows(target)
    again = engine.add(PROMPT, GenerationConfig(max_new_tokens=12))
    engine.run([again])
    assert again.stats.cached_tokens == len(PROMPT) - 1 and first.stats.cached_tokens == 0
    assert list(counted.calls[0].values()) == [(1, True)]  # no prompt read: its first step decodes
    assert again.result.tokens == first.result.tokens == solo(PROMPT, 12)


def test_a_conversations_next_turn_reads_only_the_new_turn(target):
    engine = cached_engine(target, max_rows=2)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=10))
    engine.run([first])
    next_turn(engine, target, first)


def test_kept_rows_go_to_the_longest_shared_start_and_never_exceed_max_rows(target, monkeypatch):
    """Three rows. A new prompt takes the kept row holding the most of it where that is
    PREFIX_MIN tokens or more (whatever its id), else the kept row with the lowest id (cut to
    what it shares); a new row only once none is kept."""
    from specdec import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFIX_MIN", 8)
    engine = cached_engine(target, max_rows=3)
    a = engine.add(OTHER, GenerationConfig(max_new_tokens=4))
    b = engine.add(PROMPT, GenerationConfig(max_new_tokens=4))
    engine.step()
    row_a, row_b = a.row, b.row
    assert row_a < row_b
    engine.run([a, b])
    assert sorted(engine.idle) == [row_a, row_b] and not engine.rows
    c = engine.add(PROMPT[:20] + [9, 9, 9], GenerationConfig(max_new_tokens=4))  # 20 shared with b's row
    d = engine.add([1, 2, 3, 4, 5], GenerationConfig(max_new_tokens=4))  # nothing shared
    engine.step()
    assert (c.row, c.stats.cached_tokens) == (row_b, 20)
    assert (d.row, d.stats.cached_tokens) == (row_a, 0)
    engine.run([c, d])
    e = engine.add([1, 2, 3, 4, 6, 7], GenerationConfig(max_new_tokens=4))  # 4 shared with d's (< 8)
    f = engine.add([2, 2, 2], GenerationConfig(max_new_tokens=4))
    g = engine.add([3, 3, 3], GenerationConfig(max_new_tokens=4))
    engine.step()
    assert (e.row, e.stats.cached_tokens) == (row_a, 4)  # the lowest kept id, with what it shares
    assert f.row == row_b and g.row not in (row_a, row_b)  # kept rows first, then a new one
    assert len(engine.rows) == 3 and not engine.idle
    engine.run([e, f, g])
    assert len(engine.idle) == 3
    for r, prompt in ((c, PROMPT[:20] + [9, 9, 9]), (d, [1, 2, 3, 4, 5]), (e, [1, 2, 3, 4, 6, 7]), (g, [3, 3, 3])):
        assert r.result.tokens == solo(prompt, 4)


def test_a_row_cancelled_mid_prompt_keeps_only_what_it_read(target):
    """A request cancelled while its prompt rides in chunks (4 tokens a step beside a decoding
    row) leaves a row holding those chunks; the same prompt later resumes after them."""
    engine = cached_engine(target, max_rows=2, prefill_chunk=4)
    running = engine.add(OTHER, GenerationConfig(max_new_tokens=30))
    engine.step()
    late = engine.add(PROMPT, GenerationConfig(max_new_tokens=6))
    for _ in range(3):
        engine.step()
    assert late.prefilled == 12
    row = late.row
    engine.cancel(late)
    assert engine.idle[row] == PROMPT[:12]
    again = engine.add(PROMPT, GenerationConfig(max_new_tokens=6))
    engine.run([running, again])
    assert again.stats.cached_tokens == 12
    assert again.result.tokens == solo(PROMPT, 6)
    assert running.result.tokens == solo(OTHER, 30)


def test_no_row_is_kept_where_the_target_cannot_keep_idle_rows_for_free(target):
    target.keeps_idle_rows = False  # as a model whose rows share one pool of cells
    dropped = []
    inner = target.drop_rows
    target.drop_rows = lambda rows: (dropped.extend(rows), inner(rows))
    engine = cached_engine(target, max_rows=1)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=3))
    engine.step()
    row = first.row
    engine.run([first])
    assert not engine.prefix_cache and not engine.idle and dropped == [row]
    again = engine.add(PROMPT, GenerationConfig(max_new_tokens=3))
    engine.run([again])
    assert again.stats.cached_tokens == 0


def test_drop_idle_frees_the_kept_rows(target):
    engine = cached_engine(target, max_rows=1)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=3))
    engine.run([first])
    engine.drop_idle()
    assert not engine.idle
    again = engine.add(PROMPT, GenerationConfig(max_new_tokens=3))
    engine.run([again])
    assert again.stats.cached_tokens == 0 and again.result.tokens == first.result.tokens


def test_a_prompt_found_whole_waits_for_its_waves_prompts_and_they_decode_together(target):
    """A request whose prompt is all in a kept row arrives with another: it does not decode alone
    while the other waits (on a concave curve, chunks too dear to ride), it waits one forward
    for the other's whole prompt, and the two decode in the same steps from then on."""
    counted = CountedRows(target)
    engine = cached_engine(target, max_rows=2, costs=lambda w, depth=None: w**0.5, prefill_stall=2.0)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=8))
    engine.run([first])
    again = engine.add(PROMPT, GenerationConfig(max_new_tokens=8))
    other = engine.add(OTHER, GenerationConfig(max_new_tokens=8))
    counted.calls.clear()
    engine.step()
    assert again.stats.cached_tokens == len(PROMPT) - 1
    assert counted.calls[0] == {other.row: (len(OTHER) - 1, False)}  # the other's prompt, whole
    assert counted.calls[1] == {again.row: (1, True), other.row: (1, True)}  # then one step for both
    engine.run([again, other])
    assert again.result.tokens == solo(PROMPT, 8) and other.result.tokens == solo(OTHER, 8)


def test_the_kept_row_goes_to_the_request_that_shares_most_whatever_their_order(target, monkeypatch):
    from specdec import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFIX_MIN", 8)
    engine = cached_engine(target, max_rows=2)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=3))
    engine.step()
    row = first.row
    engine.run([first])
    newcomer = engine.add(OTHER, GenerationConfig(max_new_tokens=3))  # first in the queue, shares nothing
    again = engine.add(PROMPT, GenerationConfig(max_new_tokens=3))
    engine.step()
    assert (again.row, again.stats.cached_tokens) == (row, len(PROMPT) - 1)
    assert newcomer.row != row and newcomer.stats.cached_tokens == 0


# -- host_cache: a kept row's cache copied to host memory before another prompt takes the row --------


def test_a_conversation_whose_row_went_to_another_reads_its_history_back_from_host_memory(target):
    """One row, two conversations taking turns (llama-server's --cache-ram case): each turn finds
    its history in host memory, not in the row, and reads only its new message."""
    engine = cached_engine(target, max_rows=1, host_cache=None)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=10))
    engine.run([first])
    other = engine.add(OTHER, GenerationConfig(max_new_tokens=10))  # takes the row: PROMPT's cache copied out
    engine.run([other])
    assert other.stats.cached_tokens == 0 and len(engine.host.entries) == 1
    second = next_turn(engine, target, first)
    # OTHER's conversation was copied out in its turn; the row now holds PROMPT's second turn
    held = sorted(tokens for tokens, _ in engine.host.entries.values())
    assert held == sorted([tuple(first.context[:-1]), tuple(other.context[:-1])])
    assert list(engine.idle.values()) == [second.context[:-1]]


def test_a_copy_is_read_back_where_it_gives_more_than_the_kept_row_the_request_would_take(target, monkeypatch):
    """A kept row sharing fewer than PREFIX_MIN tokens is not taken out of id order, so what the
    request would get is the lowest kept row's share: a copy sharing more than that is read back,
    even where the other kept row shares more still."""
    from specdec import engine as engine_module

    monkeypatch.setattr(engine_module, "PREFIX_MIN", 8)
    engine = cached_engine(target, max_rows=2, host_cache=None)
    near = PROMPT[:4] + [30, 30, 30, 30, 30]
    pair = [
        engine.add([9] * 6, GenerationConfig(max_new_tokens=4)),
        engine.add(near, GenerationConfig(max_new_tokens=4)),
    ]
    engine.run(pair)  # rows 0 and 1
    engine.run([engine.add(PROMPT, GenerationConfig(max_new_tokens=4))])  # takes row 0 (row 1 shares 4 < 8)
    engine.run([engine.add(OTHER, GenerationConfig(max_new_tokens=4))])  # row 0 again: PROMPT's copied out
    prompt = PROMPT[:4] + [30, 1, 2, 3]
    shares = [engine_module._shared_start(engine.idle[row], prompt) for row in (0, 1)]
    assert shares == [0, 5] and engine.host.longest(prompt[:-1])[1] == 4
    last = engine.add(prompt, GenerationConfig(max_new_tokens=4))
    engine.run([last])
    assert last.stats.cached_tokens == 4  # PROMPT's copy, into row 0: the kept row it would take shares none
    assert last.result.tokens == solo(prompt, 4)


def test_without_host_cache_the_history_is_read_again(target):
    engine = cached_engine(target, max_rows=1)
    assert engine.host is None
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=10))
    engine.run([first])
    engine.run([engine.add(OTHER, GenerationConfig(max_new_tokens=10))])
    second = engine.add(first.context + [3, 4], GenerationConfig(max_new_tokens=10))
    engine.run([second])
    assert second.stats.cached_tokens == 0 and second.result.tokens == solo(first.context + [3, 4], 10)


def test_the_host_cache_keeps_to_its_budget_least_recently_used_first():
    from specdec.engine import HostCache
    from specdec.models.base import SavedRow

    cache = HostCache(budget=100)
    cache.put([1, 2, 3], SavedRow(3, 60, "a"))
    cache.put([4, 5, 6], SavedRow(3, 30, "b"))
    assert cache.longest([1, 2, 9]) == (0, 2) and cache.take(0).data == "a"  # now the most recent
    cache.put([7, 8], SavedRow(2, 30, "c"))  # 120 bytes: the least recently used, [4, 5, 6], goes
    assert sorted(held for held, _ in cache.entries.values()) == [(1, 2, 3), (7, 8)] and cache.nbytes == 90
    cache.put([1, 2], SavedRow(2, 10, "d"))  # held by [1, 2, 3]'s copy already: nothing added
    cache.put([7, 8, 9], SavedRow(3, 40, "e"))  # holds [7, 8]: that copy goes
    assert sorted(held for held, _ in cache.entries.values()) == [(1, 2, 3), (7, 8, 9)] and cache.nbytes == 100
    cache.put(list(range(50)), SavedRow(50, 101, "f"))  # larger than the whole budget: not kept
    assert cache.nbytes == 100 and cache.longest([5]) is None


def test_a_copy_the_model_cannot_place_is_forgotten_and_the_prompt_read_whole(target):
    from specdec.errors import SpecdecError

    engine = cached_engine(target, max_rows=1, host_cache=None)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=6))
    engine.run([first])
    engine.run([engine.add(OTHER, GenerationConfig(max_new_tokens=6))])

    def refuse(row, saved):
        target.rollback_rows({row: 0})  # load_row's contract: the row is left empty
        raise SpecdecError("no room")

    target.load_row = refuse
    again = engine.add(PROMPT, GenerationConfig(max_new_tokens=6))
    engine.run([again])
    assert again.stats.cached_tokens == 0 and again.result.tokens == first.result.tokens
    assert all(held[:3] != tuple(PROMPT[:3]) for held, _ in engine.host.entries.values())


def test_where_no_row_is_kept_a_finished_rows_cache_is_copied_out_and_read_back(target):
    """A target whose rows share one pool of cells keeps no idle rows; with host memory each
    finished row's cache is copied there as the row goes (what it fed: its context but the last
    token), and a conversation's next turn, or the same prompt again, reads it back into a new
    row and reads only the rest, answering as a fresh model does."""
    target.keeps_idle_rows = False  # as a model whose rows share one pool of cells
    engine = cached_engine(target, max_rows=2, host_cache=None)
    assert not engine.prefix_cache and engine.host is not None
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=10))
    engine.run([first])
    assert not engine.idle and [held for held, _ in engine.host.entries.values()] == [tuple(first.context[:-1])]
    second = next_turn(engine, target, first)
    # the second turn's copy holds the first's: one copy left, the longer
    assert [held for held, _ in engine.host.entries.values()] == [tuple(second.context[:-1])]


@pytest.mark.parametrize("keeps", [True, False])
def test_a_cache_that_cannot_be_copied_out_is_read_again_and_nothing_fails(target, keeps):
    """Where the copy to host memory fails (the model cannot, or memory runs out) as a finished
    row goes (a pool) or as another prompt takes a kept row, the requests end as ever, rows are
    freed or reused, and the conversation's next turn reads its history again."""
    from specdec.errors import SpecdecError

    target.keeps_idle_rows = keeps

    def refuse(row):
        raise SpecdecError("no copy")

    target.save_row = refuse
    engine = cached_engine(target, max_rows=1, host_cache=None)
    first = engine.add(PROMPT, GenerationConfig(max_new_tokens=5))
    engine.run([first])
    other = engine.add(OTHER, GenerationConfig(max_new_tokens=5))  # takes the kept row, where kept
    engine.run([other])
    assert first.result.tokens == solo(PROMPT, 5) and other.result.tokens == solo(OTHER, 5)
    assert not engine.host.entries and not engine.rows
    second = engine.add(first.context + [3], GenerationConfig(max_new_tokens=5))
    engine.run([second])
    assert second.stats.cached_tokens == 0 and second.result.tokens == solo(first.context + [3], 5)


@pytest.mark.parametrize("keeps", [True, False])
def test_after_a_failed_step_no_running_row_is_kept_or_copied(target, keeps):
    """drop_idle (the server calls it when a step raised, before it ends the requests in the
    engine): the kept rows go, and the rows in use are neither kept nor copied to host memory as
    their requests end, whatever their caches were left holding."""
    target.keeps_idle_rows = keeps
    engine = cached_engine(target, max_rows=2, host_cache=None)
    done = engine.add(OTHER, GenerationConfig(max_new_tokens=3))
    engine.run([done])
    running = engine.add(PROMPT, GenerationConfig(max_new_tokens=20))
    engine.step()
    engine.step()
    copies = dict(engine.host.entries)
    engine.drop_idle()
    engine.cancel(running)
    assert not engine.idle and engine.host.entries == copies and not engine._unknown
    again = engine.add(PROMPT, GenerationConfig(max_new_tokens=6))
    engine.run([again])
    assert again.stats.cached_tokens == 0 and again.result.tokens == solo(PROMPT, 6)
    last = engine.add(PROMPT, GenerationConfig(max_new_tokens=6))  # an ordinary end is kept again
    engine.run([last])
    assert last.stats.cached_tokens == len(PROMPT) - 1


def test_a_negative_host_budget_is_refused(target):
    from specdec.errors import SpecdecError

    with pytest.raises(SpecdecError, match="host_cache"):
        cached_engine(target, host_cache=-1)


@pytest.mark.parametrize("seed", range(40))
def test_requests_coming_and_going_over_kept_rows_and_host_copies_answer_as_fresh_rows(seed):
    """Prompts sharing an opening and conversations' next turns arrive at random while others
    run, over 1-3 rows kept or (a pool of cells) not, host copies with no budget, a tight one or
    none: every request ends with the greedy tokens a fresh model gives it. (Rows taken by
    earlier requests of the same admission are copied out as it goes: a copy chosen before them
    could be gone by its turn.)"""
    import random

    rng = random.Random(seed)
    target = ToyLM(vocab_size=32, seed=1)
    target.keeps_idle_rows = seed % 2 == 0
    budget = rng.choice([None, 200, 2000, 0])
    engine = cached_engine(target, max_rows=rng.choice([1, 2, 3]), host_cache=budget)
    requests = []
    for _ in range(50):
        if rng.random() < 0.3:
            prompt = [1, 2, 3, 4] + [rng.randrange(1, 31) for _ in range(rng.randrange(1, 12))]
            done = [r for r in requests if r.done]
            if done and rng.random() < 0.5:  # a conversation's next turn
                prompt = rng.choice(done).context + [rng.randrange(1, 31)]
            requests.append(engine.add(prompt, GenerationConfig(max_new_tokens=rng.randrange(1, 8))))
        if engine.busy:
            engine.step()
    engine.run(requests)
    for r in requests:
        assert r.result.tokens == solo(r.prompt_tokens, r.config.max_new_tokens)
    assert engine.host is None or budget is None or engine.host.nbytes <= budget
