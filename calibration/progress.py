"""What a long run (``kvswap calibrate``, ``kvswap bench``) tells a progress bar."""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional


class Progress:
    """What a run tells a progress bar; the bar (tqdm) is made on the first ``add``, once
    there is a total to show. ``make(total)`` returns an object with tqdm's ``total``,
    ``refresh``, ``update``, ``set_description`` and ``close``; without it nothing is shown."""

    def __init__(self, make: Optional[Callable[[int], Any]] = None) -> None:
        self.make = make
        self.bar: Any = None

    @classmethod
    def on_stderr(cls, unit: str) -> "Progress":
        """A tqdm bar on stderr counting ``unit``s, gone when the run ends (the commands'
        bar: their tables go to stdout)."""
        from tqdm import tqdm

        return cls(lambda total: tqdm(total=total, file=sys.stderr, unit=unit, dynamic_ncols=True, leave=False,
                                      mininterval=0.5))

    def add(self, n: int) -> None:
        if self.make is None or n <= 0:
            return
        if self.bar is None:
            self.bar = self.make(n)
        else:
            self.bar.total += n
            self.bar.refresh()

    def step(self, what: str) -> None:
        if self.bar is not None:
            self.bar.set_description(what, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
