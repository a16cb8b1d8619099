"""Huge pages for llama.cpp's memory (models/hugepages.py): which mappings are asked for, once each,
a load that goes on whatever the advice does, the same logits, and serve's flag."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import numpy as np
import pytest

from specdec.models import hugepages
from specdec.models.hugepages import HUGE_PAGE, MADV_COLLAPSE, MADV_HUGEPAGE, MIN_SIZE, HugePages


def maps_line(start: int, end: int, perms: str = "rw-p", name: str = "") -> str:
    return f"{start:x}-{end:x} {perms} 00000000 00:00 0 {name}".rstrip()


def test_only_writable_private_anonymous_mappings_count():
    text = "\n".join(
        [
            maps_line(0x1000, 0x2000),  # anonymous, writable, private: counted
            maps_line(0x3000, 0x4000, name="[heap]"),
            maps_line(0x5000, 0x6000, "r--p"),
            maps_line(0x7000, 0x8000, "rw-s"),
            maps_line(0x9000, 0xA000, "r--s", "/models/m.gguf"),
            maps_line(0xB000, 0xC000, "rw-p", "/usr/lib/libc.so.6"),
        ]
    )
    assert hugepages.anonymous_regions(text) == {(0x1000, 0x2000)}


def test_a_range_is_its_whole_huge_pages_and_small_ones_are_left():
    start = 5 * HUGE_PAGE + 4096  # 2 MiB and a page past a boundary
    assert hugepages.huge_range(start, start + MIN_SIZE + HUGE_PAGE) == (6 * HUGE_PAGE, 6 * HUGE_PAGE + MIN_SIZE)
    assert hugepages.huge_range(start, start + MIN_SIZE) is None  # 3 whole pages: under MIN_SIZE
    assert hugepages.huge_range(0, MIN_SIZE) == (0, MIN_SIZE)


class FakeMadvise:
    def __init__(self, refuse=()):
        self.calls, self.refuse = [], set(refuse)

    def __call__(self, start, length, advice):
        self.calls.append((start, length, advice))
        return -1 if (start, advice) in self.refuse else 0


def watched(tmp_path: Path, regions, refuse=()):
    maps = tmp_path / "maps"
    maps.write_text("\n".join(maps_line(a, b) for a, b in regions))
    pages = HugePages(maps)
    pages._madvise = FakeMadvise(refuse)
    return maps, pages


def test_each_new_mapping_is_advised_once_and_the_old_ones_never(tmp_path):
    old = (0x100 * HUGE_PAGE, 0x110 * HUGE_PAGE)  # there before: Python's, not the model's
    maps, pages = watched(tmp_path, [old])
    weights = (0x200 * HUGE_PAGE + 4096, 0x240 * HUGE_PAGE)  # 64 MiB less a page, unaligned start
    small = (0x300 * HUGE_PAGE, 0x300 * HUGE_PAGE + MIN_SIZE - 4096)
    maps.write_text("\n".join(maps_line(a, b) for a, b in (old, weights, small)))
    pages.advise()
    assert pages._madvise.calls == [(0x201 * HUGE_PAGE, 0x3F * HUGE_PAGE, MADV_HUGEPAGE)]
    assert pages.advised == 0x3F * HUGE_PAGE
    # madvise split the mapping at the advised range: its head is new to the maps, and too small
    head, body = (weights[0], 0x201 * HUGE_PAGE), (0x201 * HUGE_PAGE, weights[1])
    maps.write_text("\n".join(maps_line(a, b) for a, b in (old, head, body, small)))
    pages.advise()
    assert len(pages._madvise.calls) == 1


def test_collapse_moves_each_2_mib_and_counts_what_the_kernel_took(tmp_path):
    maps, pages = watched(tmp_path, [])
    kv = (0x400 * HUGE_PAGE, 0x400 * HUGE_PAGE + 5 * HUGE_PAGE)
    maps.write_text(maps_line(*kv))
    pages._madvise.refuse = {(kv[0] + HUGE_PAGE, MADV_COLLAPSE)}  # a page the kernel cannot move
    pages.collapse()
    calls = pages._madvise.calls
    assert calls[0] == (kv[0], 5 * HUGE_PAGE, MADV_HUGEPAGE)
    assert calls[1:] == [(kv[0] + i * HUGE_PAGE, HUGE_PAGE, MADV_COLLAPSE) for i in range(5)]
    assert pages.collapsed == 4 * HUGE_PAGE
    pages.collapse()  # asked once
    assert len(pages._madvise.calls) == 6


def test_without_proc_maps_it_does_nothing(tmp_path):
    pages = HugePages(tmp_path / "no-such-maps")
    pages.advise()
    pages.collapse()
    assert pages.advised == pages.collapsed == 0


class FakeLib:
    llama_progress_callback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_float, ctypes.c_void_p)


def test_the_progress_callback_never_cancels_the_load(tmp_path, monkeypatch):
    """llama.cpp cancels a load whose progress callback returns false: advice that fails must not."""
    pages = HugePages(tmp_path / "maps")

    def broken():
        raise RuntimeError("no advice today")

    monkeypatch.setattr(pages, "advise", broken)
    callback = pages.progress_callback(FakeLib)
    assert callback(0.0, None) is True
    assert callback(0.5, None) is True


def test_the_progress_callback_reads_the_maps_at_the_first_call_then_once_a_step(tmp_path, monkeypatch):
    """llama.cpp calls it once a tensor: reading /proc/self/maps every time cost 170 ms of a load."""
    pages = HugePages(tmp_path / "maps")
    seen = []
    monkeypatch.setattr(pages, "advise", lambda: seen.append(True))
    callback = pages.progress_callback(FakeLib, step=0.25)
    progress = [i / 100 for i in range(101)]
    assert all(callback(x, None) for x in progress)
    assert len(seen) == 5  # 0, 0.25, 0.5, 0.75, 1.0


def test_serve_asks_for_huge_pages_unless_told_not_to(monkeypatch):
    import specdec
    from specdec.cli import build_parser
    from specdec.cli.loading import _model_loader

    seen = []
    monkeypatch.setattr(specdec, "load_model", lambda name, **kw: seen.append(kw["huge_pages"]))
    parser = build_parser()
    for argv, expected in ((["serve"], True), (["serve", "--no-huge-pages"], False), (["generate", "-p", "x"], False)):
        _model_loader(parser.parse_args(argv), 1)("qwen2.5-coder-0.5b")
        assert seen.pop() is expected


def smaps_flags(text: str) -> dict[tuple[int, int], list[str]]:
    """Each mapping's VmFlags in a /proc/<pid>/smaps text."""
    flags, current = {}, None
    for line in text.splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            current = (start, end)
        elif fields and fields[0] == "VmFlags:":
            flags[current] = fields[1:]
    return flags


@pytest.mark.real_models
@pytest.mark.skipif(sys.platform != "linux", reason="transparent huge pages are Linux's")
def test_a_model_in_huge_pages_computes_the_same_logits(draft_model):
    """Every mapping the load made, 8 MiB or more, carries the advice (VmFlags hg) on its whole 2
    MiB pages, and the same bytes in other pages give bit-identical logits. (Which buffers are
    mappings of their own is glibc's choice: past a first free, allocations under 32 MiB may come
    from the heap, which is left alone.)"""
    from specdec import load_model

    big = load_model("qwen2.5-coder-0.5b", n_ctx=2048, progress=False, huge_pages=True)
    pages = big.huge_pages
    made = hugepages.anonymous_regions(Path("/proc/self/maps").read_text()) - pages.before
    ranges = {r for r in (hugepages.huge_range(*m) for m in made) if r is not None}
    assert ranges  # the KV cache (48 MiB) at least
    flags = smaps_flags(Path("/proc/self/smaps").read_text())
    for start, end in ranges:  # the mappings over each range (madvise split them at its ends)
        over = [vm for (a, b), vm in flags.items() if a < end and b > start]
        assert over and all("hg" in vm for vm in over)
    tokens = draft_model.tokenizer.encode("def fib(n):\n    return n if n < 2 else")
    for model in (draft_model, big):
        model.reset()
    np.testing.assert_array_equal(big.forward(tokens), draft_model.forward(tokens))
