"""What a long run (``kvswap calibrate``, ``kvswap bench``) tells a progress bar."""
from __future__ import annotations

import sys
import time
from typing import Any, Callable, Optional, TextIO


class Progress:
    """What a run tells a progress bar; the bar is made on the first ``add``, once there is
    a total to show. ``make(total)`` returns an object with tqdm's ``total``, ``refresh``,
    ``update``, ``set_description`` and ``close``; without it nothing is shown."""

    def __init__(self, make: Optional[Callable[[int], Any]] = None) -> None:
        self.make = make
        self.bar: Any = None

    @classmethod
    def on_stderr(cls, unit: str, every: float = 10.0) -> Progress:
        """The commands' bar, on stderr (their tables go to stdout): a tqdm bar, gone when
        the run ends, where stderr is a terminal; elsewhere (a log, a pipe) a plain line
        every ``every`` seconds and one at the end (:class:`Lines`)."""
        stream = sys.stderr
        if not stream.isatty():
            return cls(lambda total: Lines(total, unit, stream, every))
        from tqdm import tqdm

        return cls(lambda total: tqdm(total=total, file=stream, unit=unit, dynamic_ncols=True, leave=False,
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


class Lines:
    """A progress bar for logs: ``"<done>/<total> <unit>s (<what>), <elapsed>"`` at most
    once every ``every`` seconds, and once when closed; nothing redrawn in place."""

    def __init__(self, total: int, unit: str, stream: TextIO, every: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total, self.n, self.unit, self.stream, self.every, self.clock = total, 0, unit, stream, every, clock
        self.what = ""
        self.start = self.last = clock()

    def refresh(self) -> None:
        pass

    def set_description(self, what: str, refresh: bool = True) -> None:
        self.what = what

    def update(self, k: int) -> None:
        self.n += k
        if self.clock() - self.last >= self.every:
            self._line()

    def close(self) -> None:
        if self.n:
            self._line()

    def _line(self) -> None:
        self.last = self.clock()
        what = f" ({self.what})" if self.what else ""
        print(f"  {self.n}/{self.total} {self.unit}s{what}, {self.last - self.start:.0f} s", file=self.stream,
              flush=True)
