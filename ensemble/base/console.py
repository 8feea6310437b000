"""What the frameworks print: their C++ info lines kept off the user's terminal.

Some libraries write straight to file descriptor 2 from C++, where Python's ``warnings`` and
``logging`` cannot reach: LiteRT's "INFO: Created TensorFlow Lite XNNPACK delegate for CPU." (no
switch turns it off) and absl/TensorFlow info lines ("I0000 00:00:... file.cc:12] ..."); others
hand their C++ log lines to a Python callback that prints them to stdout.
:func:`framework_info_quieted` holds both while a block runs and passes on everything but those
lines, so warnings and errors still show.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import tempfile
from typing import Iterator, Pattern

INFO_LINE = re.compile(r"^(INFO: |I\d{4} \d\d:\d\d:\d\d)")


@contextlib.contextmanager
def framework_info_quieted(*dropped: Pattern[str]) -> Iterator[None]:
    """Hold what C++ code writes to stderr (fd 2) and what Python prints to ``sys.stdout`` while
    the block runs, then pass on everything but info lines and the lines matching ``dropped``."""
    keep = lambda text: "".join(line for line in text.splitlines(keepends=True)  # noqa: E731
                                if not INFO_LINE.match(line) and not any(p.search(line) for p in dropped))
    sys.stderr.flush()
    saved = os.dup(2)
    printed = io.StringIO()
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            with contextlib.redirect_stdout(printed):
                yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            sys.stdout.write(keep(printed.getvalue()))
            sys.stderr.write(keep(held.read().decode(errors="replace")))
            sys.stdout.flush()
            sys.stderr.flush()
