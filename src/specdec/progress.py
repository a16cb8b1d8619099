"""One progress bar for every long job (model assembly, cost timing, head training, the bench):
tqdm's, on stderr, with the rate and an estimate of the time left. A job that is off (progress
False) draws nothing."""

from __future__ import annotations

import sys
import time


class Progress:
    """A bar of `total` `unit`s: update(done) moves it to `done` (a resumed job starts its rate
    there), close() ends its line. `scale`: counts in k, M, G (bytes)."""

    def __init__(self, label: str, total: int, unit: str, enabled: bool = True, scale: bool = False):
        from tqdm import tqdm

        self.bar = tqdm(
            total=total,
            desc=label,
            unit=unit,
            unit_scale=scale,
            disable=not enabled,
            file=sys.stderr,
            mininterval=0.5,
            dynamic_ncols=True,
            leave=True,
        )
        self.done = None

    def update(self, done: int, extra: str = "", force: bool = False) -> None:
        if self.bar.disable:
            self.done = done
            return
        if self.done is None:  # the first count: a resumed job's rate counts this run's work only
            self.bar.n = self.bar.last_print_n = self.done = done
            self.bar.start_t = self.bar.last_print_t = time.time()
        self.bar.update(done - self.done)
        self.done = done
        if extra:
            self.bar.set_postfix_str(extra, refresh=False)
        if force:
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()
