"""Progress notes: a bar's replacement outside a terminal, at most one line per interval, with an ETA."""

from __future__ import annotations

import logging

import pytest

import sinv_prune.progress as progress


def notes_of(caplog, monkeypatch, loop, interval: float) -> list[str]:
    monkeypatch.setattr(progress, "NOTE_EVERY_S", interval)
    with caplog.at_level(logging.INFO, logger="sinv_prune"), progress.progress_mode("notes"):
        loop()
    return [r.getMessage() for r in caplog.records if getattr(r, "console", False)]


def test_notes_say_stage_done_total_and_eta(caplog, monkeypatch):
    lines = notes_of(caplog, monkeypatch, lambda: list(progress.bar(range(4), desc="scoring", unit="batch")), 0.0)
    assert lines == [f"scoring: {i} / 4 batch, 00:00 elapsed, ETA 00:00" for i in (1, 2, 3)]  # none at 0 or 4


def test_notes_wait_for_the_interval(caplog, monkeypatch):
    def loop():
        bar = progress.bar(total=5, desc="training", unit="step")
        for _ in range(5):
            bar.update(1)
        bar.close()

    assert notes_of(caplog, monkeypatch, loop, 30.0) == []


def test_eta_follows_the_pace_so_far():
    assert progress.note_line("search", 10, 40, "plan", 60.0) == "search: 10 / 40 plan, 01:00 elapsed, ETA 03:00"
    assert progress.note_line("lm-eval", 7, None, "it", 5.0) == "lm-eval: 7 it, 00:05 elapsed"


def test_modes_bars_off_and_unknown():
    with progress.progress_mode("off"):
        assert progress.bar(range(3), desc="x").disable
    assert progress.current_mode() == "bars"
    shown = progress.bar(range(3), desc="x")
    assert not shown.disable and not isinstance(shown, progress.NoteBar)
    shown.close()
    with pytest.raises(ValueError, match="progress mode must be one of bars, notes, off, got 'loud'"), \
            progress.progress_mode("loud"):  # fmt: skip
        pass
