"""The run's console: at default verbosity, outside a terminal, one line per finished stage or arm and the
summary; the detail (training metrics, transformers' warnings) in run.log; ``-v`` brings it back."""

from __future__ import annotations

import logging

import pytest
from test_pipeline import invoke, recipe_file

from sinv_prune.cli import _console


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("console")
    result = invoke(recipe_file(tmp), "--output", tmp / "out")  # CliRunner: stdout and stderr are not terminals
    assert result.exit_code == 0, result.output
    return tmp / "out", result.output


def test_default_console_is_short_and_run_log_keeps_the_detail(default_run):
    out, console = default_run
    lines = console.splitlines()
    assert len(lines) < 60 and len(console.encode()) < 8 * 1024, console
    assert "\r" not in console and "it/s" not in console  # no progress-bar redraws in a log
    assert "step 6:" not in console and "loss_type" not in console and "sinv/" not in console
    assert "trained the base model: 6 steps" in console
    assert sum("fine-tuned 2 steps" in line for line in lines) == 4  # one line per arm
    assert "taylor-2-global" in console and "report: " in console  # the summary
    log = (out / "run.log").read_text()
    assert "step 6: {" in log and "score report sinv_early" in log


def test_run_log_takes_transformers_warnings(tmp_path):
    """(transformers says some only once per process, so this is checked on its own.)"""
    from sinv_prune.pipeline.stages import _log_to_file

    handler = _log_to_file(tmp_path / "run.log")
    try:
        logging.getLogger("transformers.modeling_utils").warning("a transformers warning")
        logging.getLogger("transformers.modeling_utils").info("an info line it keeps to itself")
    finally:
        logging.getLogger("sinv_prune").removeHandler(handler)
        logging.getLogger("transformers").removeHandler(handler)
        handler.close()
    log = (tmp_path / "run.log").read_text()
    assert "WARNING transformers.modeling_utils: a transformers warning" in log and "info line" not in log


@pytest.mark.parametrize("verbose", [False, True])
def test_verbose_console_shows_every_line(capfd, verbose):
    log = logging.getLogger("sinv_prune")
    hf = logging.getLogger("transformers")
    before = list(hf.handlers)
    with _console(quiet=False, verbose=verbose):
        log.info("detail line")
        log.info("stage line", extra={"console": True})
        log.warning("a warning")
        during = list(hf.handlers)  # without -v, transformers' own stderr handler is off
    err = capfd.readouterr().err
    assert "stage line" in err and "a warning" in err
    assert ("detail line" in err) == verbose
    assert (during == before) == verbose and len(during) >= len(before) - 1
    assert set(hf.handlers) == set(before)  # restored after the run


def test_the_gguf_conversion_bar_follows_transformers_progress_setting():
    """transformers' GGUF loader draws a plain tqdm bar even with its progress bars disabled."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    from sinv_prune.surgery.checkpoint import _gguf_bar_follows_transformers

    original = gguf_utils.tqdm
    hf_logging.disable_progress_bar()
    try:
        with _gguf_bar_follows_transformers():
            assert gguf_utils.tqdm(range(3), desc="Converting").disable
    finally:
        hf_logging.enable_progress_bar()
    assert gguf_utils.tqdm is original
    with _gguf_bar_follows_transformers():
        assert gguf_utils.tqdm is original  # bars enabled: untouched


# -- progress without a terminal, lm-eval's chatter --------------------------------------------------

TASKS_RECIPE = {
    "name": "notes",
    "seed": 0,
    "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
    "data": {"synthetic": {"seed": 0, "num_train": 200, "num_valid": 30, "num_test": 30},
             "tokenizer": {"kind": "word"}, "seq_len": 32},
    "train": {"max_steps": 4, "batch_size": 8, "learning_rate": 0.003},
    "score": {"batches": 2, "batch_size": 4},
    "prune": {"arms": [{"criterion": "taylor", "amount": 2}]},
    "evaluate": {"speed": False, "prompts": [], "tasks": ["mc"]},
}  # fmt: skip
BAR_MARKS = ("it/s", "\r", "|█", "%|")


@pytest.fixture(scope="module")
def task_recipe(tmp_path_factory):
    pytest.importorskip("lm_eval", reason='lm-eval is not installed (pip install "sinv_prune[eval]")')
    from test_lmeval import mc_task

    tmp = tmp_path_factory.mktemp("notes")
    mc_task(tmp / "mc", words=["lo", "li", "la", "le", "lu"], n=12)
    return recipe_file(tmp, TASKS_RECIPE)


@pytest.mark.parametrize("flags", [(), ("--quiet",), ("-v",)], ids=["default", "quiet", "verbose"])
def test_progress_outside_a_terminal(task_recipe, tmp_path, monkeypatch, flags):
    """A captured run (no terminal) writes note lines with an ETA and no bars; -q neither; -v lm-eval's bars."""
    import sinv_prune.progress

    monkeypatch.setattr(sinv_prune.progress, "NOTE_EVERY_S", 0.0)  # a note at every update
    result = invoke(task_recipe, "--output", tmp_path / "out", *flags)
    assert result.exit_code == 0, result.output
    console = result.output
    notes = [line for line in console.splitlines() if ", ETA " in line]
    lm_eval_bars = "Running loglikelihood requests:" in console and "it/s" in console
    if not flags:
        assert not any(mark in console for mark in BAR_MARKS), console
        assert "training: 2 / 4 step, " in console and "scoring: 1 / 2 batch, " in console
        assert "perplexity: 8 / 32 window, " in console
        assert any(line.startswith("Running loglikelihood requests: ") for line in notes)  # lm-eval's, as notes
        assert "bootstrapping" not in console and "Building contexts" not in console
    elif flags == ("--quiet",):
        assert not notes and not any(mark in console for mark in BAR_MARKS) and "bootstrapping" not in console
    else:
        assert lm_eval_bars and "Building contexts for tiny_mc" in console  # lm-eval's bars and INFO lines
    assert "tiny_mc" in (tmp_path / "out" / "results.json").read_text()


# -- sinv-prune eval: the same console as a run ------------------------------------------------------


@pytest.fixture(scope="module")
def eval_source(tmp_path_factory):
    """A tiny GPT-2 with its word tokenizer, a local multiple-choice task and a stand-in WikiText-2 test text."""
    pytest.importorskip("lm_eval", reason='lm-eval is not installed (pip install "sinv_prune[eval]")')
    from conftest import tiny_model
    from test_lmeval import WORDS, fake_wikitext, mc_task, word_tokenizer

    tmp = tmp_path_factory.mktemp("eval_console")
    tiny_model("gpt2").save_pretrained(tmp / "model")
    word_tokenizer([" ".join(WORDS)]).save_pretrained(tmp / "model")
    mc_task(tmp / "mc", n=12)
    (tmp / "wikitext").mkdir()
    fake_wikitext(tmp / "wikitext" / "test.txt", paragraphs=10)
    return tmp


@pytest.mark.parametrize("flags", [(), ("-q",), ("--verbose",)], ids=["default", "quiet", "verbose"])
def test_eval_takes_quiet_and_verbose_like_a_run(eval_source, monkeypatch, flags):
    """Outside a terminal: note lines by default, nothing with -q, lm-eval's bars and log lines with -v;
    the results print in every case."""
    from click.testing import CliRunner

    import sinv_prune.progress
    from sinv_prune.cli import main

    monkeypatch.setattr(sinv_prune.progress, "NOTE_EVERY_S", 0.0)  # a note at every update
    monkeypatch.setenv("SINV_PRUNE_WIKITEXT", str(eval_source / "wikitext"))
    args = ["eval", str(eval_source / "model"), "--tasks", str(eval_source / "mc"), "--perplexity", "--batch-size", "4"]
    result = CliRunner().invoke(main, [*args, *flags])
    assert result.exit_code == 0, result.output
    console = result.output
    assert "tiny_mc" in console and "WikiText-2 test perplexity: " in console  # the results
    notes = [line for line in console.splitlines() if ", ETA " in line]
    if not flags:
        assert not any(mark in console for mark in BAR_MARKS), console
        assert any(line.startswith("perplexity: ") for line in notes), console
        assert any(line.startswith("Running loglikelihood requests: ") for line in notes), console
        assert "Building contexts" not in console
    elif flags == ("-q",):
        assert not notes and not any(mark in console for mark in BAR_MARKS), console
    else:
        assert "Running loglikelihood requests:" in console and "it/s" in console  # lm-eval's bars
        assert "Building contexts for tiny_mc" in console  # and its INFO lines
