"""The torch thread count a run uses: ``--threads auto`` (the default), a number, and how it is applied."""

from __future__ import annotations

import os

import pytest
import torch
import transformers
from click.testing import CliRunner

from sinv_prune.cli import main
from sinv_prune.pipeline import stages as pipeline
from sinv_prune.pipeline import threads
from sinv_prune.pipeline.recipe import load_recipe
from sinv_prune.pipeline.threads import PARAMS_PER_THREAD, choose_threads, parse_threads


@pytest.fixture
def machine(monkeypatch):
    """Pretend cores (affinity, cgroup quota) and load; returns a setter."""

    def set_machine(affinity: int, load: float | None, quota: int | None = None, cpu_count: int = 64):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)), raising=False)
        monkeypatch.setattr(os, "cpu_count", lambda: cpu_count)
        monkeypatch.setattr(threads, "_cgroup_cpu_quota", lambda: quota)
        if load is None:
            monkeypatch.delattr(os, "getloadavg", raising=False)
        else:
            monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))

    return set_machine


def test_small_model_gets_one_thread_even_on_a_free_machine(machine):
    machine(affinity=16, load=0.0)
    choice = choose_threads("auto", n_params=PARAMS_PER_THREAD // 40)  # the quickstart's size
    assert choice.threads == 1
    assert "16 usable CPUs" in choice.reason and "non-embedding parameters" in choice.reason


def test_large_model_gets_the_free_cores_and_never_more_than_the_affinity(machine):
    machine(affinity=16, load=0.0, cpu_count=64)
    assert choose_threads("auto", n_params=100 * PARAMS_PER_THREAD).threads == 16
    machine(affinity=16, load=10.0, cpu_count=64)  # ten cores busy with other work
    assert choose_threads("auto", n_params=100 * PARAMS_PER_THREAD).threads == 6
    machine(affinity=16, load=40.0)  # overloaded: still one thread
    assert choose_threads("auto", n_params=100 * PARAMS_PER_THREAD).threads == 1


def test_medium_model_is_sized_by_its_parameters(machine):
    machine(affinity=16, load=0.0)
    assert choose_threads("auto", n_params=3 * PARAMS_PER_THREAD + 1).threads == 3


def test_cgroup_quota_lowers_the_usable_cores(machine):
    machine(affinity=64, load=0.0, quota=2)
    choice = choose_threads("auto", n_params=100 * PARAMS_PER_THREAD)
    assert choice.threads == 2 and "2 usable CPUs" in choice.reason


def test_unknown_size_and_no_load_average(machine):
    machine(affinity=4, load=None)
    assert choose_threads("auto", n_params=None).threads == 4


def test_an_explicit_count_is_used_as_given(machine):
    machine(affinity=2, load=5.0)
    assert choose_threads(3, n_params=10).threads == 3
    assert choose_threads("3", n_params=10).threads == 3


@pytest.mark.parametrize("bad", [0, -1, "0", "x", "", 2.5, True, "2.0"])
def test_parse_threads_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="threads: expected 'auto' or a positive integer"):
        parse_threads(bad)


def test_parse_threads_accepts():
    assert [parse_threads(v) for v in ("auto", None, 4, "4", " 2 ")] == ["auto", None, 4, 4, 2]


def test_torch_threads_sets_and_restores(monkeypatch, caplog):
    monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    torch.set_num_threads(2)
    try:
        with caplog.at_level("INFO", logger="sinv_prune"), threads.torch_threads(threads.ThreadChoice(1, "why")):
            assert torch.get_num_threads() == 1
            assert os.environ["TOKENIZERS_PARALLELISM"] == "false"
        assert torch.get_num_threads() == 2 and "TOKENIZERS_PARALLELISM" not in os.environ
        assert [r.getMessage() for r in caplog.records] == ["torch threads: 1 (why)"]
    finally:
        torch.set_num_threads(1)


def test_recipe_params_counts_the_quickstart_without_embeddings():
    recipe = load_recipe("quickstart")
    with torch.device("meta"):
        model = transformers.GPT2Model(transformers.GPT2Config(**recipe.model.config))
    expected = sum(p.numel() for name, p in model.named_parameters() if not name.startswith(("wte", "wpe")))
    assert threads.recipe_params(recipe) == expected


@pytest.mark.parametrize(("requested", "expected"), [("auto", 1), (2, 2)])
def test_run_recipe_applies_the_choice_and_restores_it(tmp_path, machine, requested, expected):
    machine(affinity=8, load=0.0)
    seen = []

    def stop(run):
        seen.append(torch.get_num_threads())
        raise pipeline.RunStageError("stop here")

    torch.set_num_threads(3)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pipeline, "prepare_data", stop)
            with pytest.raises(pipeline.RunStageError):
                pipeline.run_recipe(load_recipe("quickstart"), tmp_path / "run", threads=requested)
        assert seen == [expected] and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(1)
    log = (tmp_path / "run" / "run.log").read_text()
    assert log.count("torch threads:") == 1 and f"torch threads: {expected} (" in log


def test_cli_passes_auto_by_default_and_rejects_bad_values(tmp_path, monkeypatch):
    calls = []

    def fake_run_recipe(recipe, output, **kwargs):
        calls.append(kwargs["threads"])
        raise pipeline.RunStageError("stop here")

    monkeypatch.setattr(pipeline, "run_recipe", fake_run_recipe)
    runner = CliRunner()
    assert runner.invoke(main, ["quickstart", "--output", str(tmp_path / "a")]).exit_code == 2
    assert runner.invoke(main, ["quickstart", "--output", str(tmp_path / "b"), "--threads", "2"]).exit_code == 2
    assert calls == ["auto", 2]
    bad = runner.invoke(main, ["quickstart", "--threads", "many", "--dry-run"])
    assert bad.exit_code == 2 and bad.output.strip().splitlines() == [
        "error: --threads: expected 'auto' or a positive integer, got 'many'"
    ]
    assert runner.invoke(main, ["quickstart", "--threads", "auto", "--dry-run"]).exit_code == 0
