"""Transparent huge pages for the memory llama.cpp takes while it loads a model (Linux).

A one-token forward on a CPU reads every weight once, and with 4 KiB pages a 1 GiB model is a
quarter of a million pages, each a TLB entry the core must walk the page tables for. Linux's usual
THP mode is `madvise` (/sys/kernel/mm/transparent_hugepage/enabled): a mapping gets 2 MiB pages
only where the program asks, and llama.cpp's CPU backend does not ask. `HugePages` asks for the
anonymous mappings that appear while a model loads:

  - the weights llama.cpp copies into buffers of its own (the repacked ones; every one without
    mmap), from the model's progress callback, which llama.cpp calls before each tensor it reads,
    once that kind's buffers are allocated: they are then faulted in as 2 MiB pages;
  - the KV cache and the compute buffers, which the context clears as it makes them, so they are
    already in small pages: `collapse()` has the kernel copy them into huge ones (MADV_COLLAPSE).

It costs load time (the kernel compacts memory to find 2 MiB pages: the 1.5B's load went from 1.1
to 2.3-2.9 s here) for 1-3% a token, so `specdec serve` asks for it (one load, hours of tokens) and
the library does not by default; docs/results/provenance.md#huge-pages has the measurements. Nothing here
changes a result: the same bytes in bigger pages. Where /proc/self/maps cannot be read or there is
no madvise (not Linux), it does nothing; where THP is `never` the kernel ignores the advice, and
where it is `always` the advice changes nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path

MADV_HUGEPAGE = 14  # linux/mman.h
MADV_COLLAPSE = 25  # Linux 6.1
HUGE_PAGE = 2 << 20
MIN_SIZE = 8 << 20  # smaller mappings are not worth it (Python's own arenas are smaller)
MAPS = Path("/proc/self/maps")

_madvise = None


def anonymous_regions(maps_text: str) -> set[tuple[int, int]]:
    """The writable private anonymous mappings (start, end) of a /proc/<pid>/maps text."""
    regions = set()
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) != 5 or fields[1][:2] != "rw" or fields[1][3:] != "p":
            continue  # named (a file, [heap], [stack]), read-only or shared
        start, _, end = fields[0].partition("-")
        regions.add((int(start, 16), int(end, 16)))
    return regions


def huge_range(start: int, end: int) -> tuple[int, int] | None:
    """The whole 2 MiB pages inside [start, end), or None where they come to under MIN_SIZE."""
    first = -(-start // HUGE_PAGE) * HUGE_PAGE
    last = end // HUGE_PAGE * HUGE_PAGE
    return (first, last) if last - first >= MIN_SIZE else None


def _libc_madvise():
    global _madvise
    if _madvise is None:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).madvise
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _madvise = fn
    return _madvise


class HugePages:
    """Asks for huge pages on the anonymous mappings that appear after it is made. `advise()` may
    be called any number of times; each range is asked for once. `advised`: the bytes asked for
    before they were written; `collapsed`: the bytes the kernel moved into huge pages after;
    `before`: the mappings there when it was made (None where they cannot be read)."""

    def __init__(self, maps: Path = MAPS):
        self.maps = maps
        self.advised = self.collapsed = 0
        self._done: set[tuple[int, int]] = set()
        try:
            self.before = anonymous_regions(maps.read_text())
            self._madvise = _libc_madvise()
        except (OSError, AttributeError, TypeError):  # no /proc, or no madvise in libc (not Linux)
            self.before = None

    def _new_ranges(self) -> list[tuple[int, int]]:
        """The huge-page ranges of mappings made since, not yet asked for."""
        if self.before is None:
            return []
        try:
            regions = anonymous_regions(self.maps.read_text())
        except OSError:
            return []
        ranges = []
        for start, end in sorted(regions - self.before):
            pages = huge_range(start, end)
            # madvise splits a mapping at the range it advises: the head and tail left beside an
            # advised range are under 2 MiB, and the range itself comes back the same
            if pages is not None and pages not in self._done:
                self._done.add(pages)
                ranges.append(pages)
        return ranges

    def advise(self) -> None:
        """Huge pages for the new mappings, as they are faulted in from now on."""
        for start, end in self._new_ranges():
            if self._madvise(start, end - start, MADV_HUGEPAGE) == 0:
                self.advised += end - start

    def collapse(self) -> None:
        """Huge pages for the new mappings, their pages already written moved into them now (2 MiB
        at a time: the kernel refuses a page it cannot move and goes on with the next)."""
        for start, end in self._new_ranges():
            if self._madvise(start, end - start, MADV_HUGEPAGE) != 0:
                continue
            for page in range(start, end, HUGE_PAGE):
                if self._madvise(page, HUGE_PAGE, MADV_COLLAPSE) == 0:
                    self.collapsed += HUGE_PAGE

    def progress_callback(self, lib, step: float = 0.05):
        """A llama_progress_callback that advises and lets the load go on. Returning false would
        cancel the load, so nothing raised in it escapes. llama.cpp calls it once a tensor (340
        times for the 1.5B) and the buffers are made before the first call, so it reads the maps
        at the first call and then once every `step` of the load (reading them every time took
        170 ms of a 1-2.7 s load); a mapping made later is still asked for by `collapse()`."""
        last = [None]

        def on_progress(progress, user_data) -> bool:
            if last[0] is not None and progress - last[0] < step:
                return True
            last[0] = progress
            try:
                self.advise()
            except Exception:  # noqa: BLE001 - the advice is optional, the load is not
                pass
            return True

        return lib.llama_progress_callback(on_progress)
