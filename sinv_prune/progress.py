"""Progress of long loops: a tqdm bar on a terminal, a note line now and then in a log or a pipe.

A bar redraws several times a second: one line on a terminal, thousands in a log. Where no terminal
shows the run (``sinv-prune run`` decides, through :func:`progress_mode`), a loop's bar instead logs
one line at most every :data:`NOTE_EVERY_S` seconds, to the console and ``run.log``::

    scoring: DONE / TOTAL batch, MM:SS elapsed, ETA MM:SS

Loops (scoring, training, fine-tuning, evaluation, allocation searches, exports, lm-eval's requests)
get their bar from :func:`bar`; the mode is one setting for the process, as transformers' own
``disable_progress_bar`` is. Outside ``sinv-prune run`` it stays ``"bars"`` (tqdm.auto, as before).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

from tqdm.auto import tqdm as auto_tqdm
from tqdm.std import tqdm as std_tqdm

logger = logging.getLogger("sinv_prune")

#: Seconds between two notes of one loop (tests set 0: a note at every update).
NOTE_EVERY_S = 30.0
MODES = ("bars", "notes", "off")
_mode = "bars"


@contextlib.contextmanager
def progress_mode(mode: str) -> Iterator[None]:
    """Inside the block, :func:`bar` draws bars (``"bars"``), logs notes (``"notes"``) or shows nothing (``"off"``)."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
    before, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = before


def current_mode() -> str:
    """The mode :func:`bar` follows now."""
    return _mode


def bar(iterable=None, *, desc: str, total: float | None = None, unit: str = "it", disable: bool = False, **kwargs):
    """A progress bar over ``iterable`` (or updated by hand up to ``total``) as the current mode shows it.

    ``kwargs`` (``leave``, ``dynamic_ncols``, ...) go to tqdm when it draws a bar.
    """
    if disable or _mode == "off":
        return std_tqdm(iterable, total=total, disable=True)
    if _mode == "notes":
        return NoteBar(iterable, desc=desc, total=total, unit=unit)
    return auto_tqdm(iterable, desc=desc, total=total, unit=unit, **kwargs)


class _Nowhere:
    """A file that takes tqdm's writes and keeps nothing."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass


class NoteBar(std_tqdm):
    """A tqdm that draws nothing and logs ``desc: done / total unit, elapsed, ETA`` at most every NOTE_EVERY_S.

    No note at the start or the end (the stage's own line says it finished), so a short loop logs nothing.
    """

    def __init__(self, *args, **kwargs):
        self._noted_at: float | None = None
        kwargs.update(file=_Nowhere(), mininterval=min(NOTE_EVERY_S, 1.0), dynamic_ncols=False)
        super().__init__(*args, **kwargs)

    def display(self, msg=None, pos=None) -> bool:
        if not self.n or (self.total is not None and self.n >= self.total) or self.disable:
            return True
        now = self._time()
        if now - (self._noted_at or self.start_t) >= NOTE_EVERY_S:
            self._noted_at = now
            line = note_line(self.desc, self.n, self.total, self.unit, now - self.start_t)
            logger.info(line, extra={"console": True})
        return True


def note_line(desc: str, done: float, total: float | None, unit: str, elapsed: float) -> str:
    """``desc: done / total unit, elapsed, ETA`` (no total: no ETA); the ETA assumes the pace so far."""
    spent = std_tqdm.format_interval(elapsed)
    if not total:
        return f"{desc}: {done:,.0f} {unit}, {spent} elapsed"
    eta = std_tqdm.format_interval(elapsed * (total - done) / done)
    return f"{desc}: {done:,.0f} / {total:,.0f} {unit}, {spent} elapsed, ETA {eta}"
