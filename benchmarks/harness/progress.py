"""Progress of a long loop that does not flood a log.

On a terminal: a tqdm bar redrawn at most once a second. Anywhere else (a CI log, a file, a pipe):
one line at every quarter of the way, so a log of a long job gets a few lines per loop instead of
thousands of carriage-return updates. Both go to stderr, leaving stdout to the tables.
"""

import sys
from typing import TextIO

from tqdm.auto import tqdm

# Lines per loop on a non-interactive stream.
_LINES = 4


class Progress:
    """Reports `done` of `total` steps of a loop named `description`."""

    def __init__(self, total: int, description: str, stream: TextIO | None = None):
        self.total = total
        self.description = description
        self.stream = sys.stderr if stream is None else stream
        self.interactive = self.stream.isatty()
        self.bar = tqdm(total=total, desc=description, file=self.stream, mininterval=1.0,
                        leave=False) if self.interactive else None
        self.reported = 0

    def update(self, done: int, note: str = "") -> None:
        """Records that `done` steps are done (`note`, e.g. the latest losses, goes with it)."""
        if self.bar is not None:
            self.bar.update(done - self.bar.n)
            self.bar.set_postfix_str(note, refresh=False)
            return
        quarter = done * _LINES // max(self.total, 1)
        if quarter > self.reported:
            self.reported = quarter
            print(f"{self.description}: {done}/{self.total} steps {note}".rstrip(),
                  file=self.stream, flush=True)

    def close(self) -> None:
        """Ends the report (removes the bar on a terminal)."""
        if self.bar is not None:
            self.bar.close()
