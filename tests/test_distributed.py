"""A recipe under ``torchrun --nproc_per_node 2`` (gloo on the CPU) against the same recipe in one process.

What must agree, and what need not: the starting model is a fixed checkpoint (no train stage),
and scoring, pruning and evaluation run on the main process alone, so the heads removed, the
baseline perplexity and each arm's perplexity before fine-tuning are the same as in one process.
Fine-tuning is data-parallel: each of the two processes sees half the batches, so the fine-tuned
weights (and perplexities) differ from a one-process run and are only checked to exist.

A second recipe (LLaMA layout) runs the later features the same way: MLP and mixed ``rounds``, a
non-uniform allocation, ``evaluate.tasks`` on a local task and ``export.gguf``; task scores of the
pruned models and GGUF sizes (same shapes) match the one-process run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_pipeline import TINY, invoke, recipe_file

from sinv_prune import data as data_mod
from sinv_prune.pipeline import stages as pipeline
from sinv_prune.pipeline.recipe import validate_recipe
from sinv_prune.pipeline.starting_model import build_model

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]


def saved_base(path: Path) -> Path:
    """TINY's untrained starting model and its word tokenizer, saved as a checkpoint directory."""
    recipe = validate_recipe(TINY)
    corpus = pipeline.load_corpus(recipe)
    tokenizer = data_mod.train_tokenizer(corpus["train"], kind="word", vocab_size=recipe.data.tokenizer.vocab_size)
    model = build_model(recipe, vocab_size=len(tokenizer), tokenizer=tokenizer)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def torchrun(*args, cwd: Path, guard: Path | None = None) -> subprocess.CompletedProcess:
    """``sinv-prune ARGS`` in two processes; with ``guard``, the non-main one may not write under it
    (``tests/rank_guard.py``: any write there fails the launch)."""
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    entry = [str(REPO / "tests" / "rank_guard.py"), str(guard)] if guard else ["-m", "sinv_prune.cli"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               *entry, *map(str, args)]  # fmt: skip
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def failure(launched: subprocess.CompletedProcess) -> str:
    """A failed launch's story: a non-main rank's refused write first (rank_guard.py), then the tails."""
    refused = [line for line in launched.stderr.splitlines() if "is not the main process but wrote" in line]
    return "\n".join(refused[:3]) + "\n" + launched.stdout[-2000:] + launched.stderr[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ddp")
    data = {
        **TINY,
        "model": {"path": str(saved_base(tmp / "start"))},
        "data": {**TINY["data"], "tokenizer": {"kind": "model"}},
        "train": None,
        "prune": {"arms": [{"criterion": "magnitude", "amount": 2}, {"criterion": "taylor", "amount": 2}]},
        "finetune": {"max_steps": 2, "batch_size": 4},
    }
    recipe = recipe_file(tmp, data)
    single = invoke(recipe, "--output", tmp / "one", "--quiet", "--threads", 1)
    assert single.exit_code == 0, single.output
    launched = torchrun(recipe, "--output", tmp / "two", "--threads", 1, cwd=tmp, guard=tmp / "two")
    assert launched.returncode == 0, failure(launched)
    return tmp, launched


def test_two_processes_prune_and_evaluate_as_one(runs):
    tmp, _ = runs
    one = json.loads((tmp / "one" / "results.json").read_text())
    two = json.loads((tmp / "two" / "results.json").read_text())
    assert two["baseline"]["perplexity"] == pytest.approx(one["baseline"]["perplexity"], rel=1e-4)
    assert [a["name"] for a in two["arms"]] == [a["name"] for a in one["arms"]]
    for a, b in zip(one["arms"], two["arms"], strict=True):
        assert b["removed"] == a["removed"] and b["heads_removed"] == a["heads_removed"] == 2
        assert b["pruned"]["perplexity"] == pytest.approx(a["pruned"]["perplexity"], rel=1e-4)
        assert b["finetuned"]["perplexity"] > 1  # fine-tuned (by both processes)
    state = json.loads((tmp / "two" / "state.json").read_text())
    assert state["finished"] == ["train", "score", "prune", "finetune", "evaluate", "report"]  # train: saved base/
    assert all(state["arms"][a["name"]]["finetune"]["steps"] == 2 for a in two["arms"])


def test_one_process_writes_the_run_directory(runs):
    tmp, launched = runs
    out = tmp / "two"
    assert [p.relative_to(out) for p in out.rglob("results.json")] == [Path("results.json")]
    assert not [p for p in out.rglob(".*")]  # no temp file of an interrupted or competing write
    log = (out / "run.log").read_text().splitlines()
    messages = [line.split(" ", 2)[2] for line in log]  # without the timestamp
    assert len(messages) == len(set(messages)), "a line was logged twice"
    assert sum("run tiny in" in m and "processes=2" in m for m in messages) == 1
    assert launched.stdout.count("report: ") == 1  # the summary, printed once


def test_an_error_on_the_main_process_stops_every_process_with_one_message(runs):
    tmp, _ = runs
    before = (tmp / "two" / "results.json").read_text()
    launched = torchrun(tmp / "tiny.yaml", "--output", tmp / "two", "--threads", 1, cwd=tmp)  # exists: no --overwrite
    errors = [line for line in launched.stderr.splitlines() if line.startswith("error: ")]
    assert launched.returncode != 0 and len(errors) == 1 and "--overwrite" in errors[0], launched.stderr[-3000:]
    assert (tmp / "two" / "results.json").read_text() == before


def test_resume_under_torchrun_finishes_an_interrupted_finetune(runs):
    """As if the launch had stopped while fine-tuning the second arm: --resume redoes that arm only."""
    tmp, _ = runs
    out = tmp / "resumed"
    shutil.copytree(tmp / "two", out)
    state = json.loads((out / "state.json").read_text())
    state["finished"] = ["train", "score", "prune"]
    for key in ("finetuned", "finetuned_dir", "finetune"):
        del state["arms"]["taylor-2-global"][key]
    (out / "state.json").write_text(json.dumps(state))
    shutil.rmtree(out / "arms" / "taylor-2-global" / "finetuned")
    (out / "results.json").unlink()
    kept = (out / "arms" / "magnitude-2-global" / "finetuned" / "model.safetensors").stat().st_mtime_ns

    launched = torchrun(tmp / "tiny.yaml", "--output", out, "--resume", "--threads", 1, "--quiet", cwd=tmp, guard=out)
    assert launched.returncode == 0, failure(launched)
    state = json.loads((out / "state.json").read_text())
    assert state["finished"] == ["train", "score", "prune", "finetune", "evaluate", "report"]
    assert state["arms"]["taylor-2-global"]["finetune"]["steps"] == 2
    assert (out / "arms" / "magnitude-2-global" / "finetuned" / "model.safetensors").stat().st_mtime_ns == kept
    results = json.loads((out / "results.json").read_text())
    assert all(arm["finetuned"]["perplexity"] > 1 for arm in results["arms"])
    messages = [line.split(" ", 2)[2] for line in (out / "run.log").read_text().splitlines()]
    assert sum("resume=True, processes=2" in m for m in messages) == 1


# -- MLP / mixed rounds, a non-uniform allocation, zero-shot tasks and GGUF export ----------------------

LLAMA = {"architecture": "llama", "config": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                             "hidden_size": 32, "intermediate_size": 64}}  # fmt: skip
MIXED_ARMS = [
    {"criterion": "taylor", "unit": "mlp", "amount": 0.25, "mode": "uniform", "rounds": 2},
    {"parts": [{"criterion": "magnitude", "amount": 2}, {"criterion": "magnitude", "unit": "mlp", "amount": 16}],
     "rounds": 2},
    {"criterion": "activation", "unit": "mlp", "options": {"metric": "magnitude"}, "amount": {"params": 0.1},
     "allocation": "sensitivity"},
]  # fmt: skip


@pytest.fixture(scope="module")
def mixed_runs(tmp_path_factory):
    """One recipe with every later stage's features, in one process and under torchrun (non-main ranks guarded)."""
    pytest.importorskip("lm_eval", reason='lm-eval is not installed (pip install "sinv_prune[eval]")')
    from tests.test_lmeval import mc_task

    tmp = tmp_path_factory.mktemp("ddp_mixed")
    start = validate_recipe({**TINY, "model": LLAMA})
    corpus = pipeline.load_corpus(start)
    tokenizer = data_mod.train_tokenizer(corpus["train"], kind="word", vocab_size=start.data.tokenizer.vocab_size)
    model = build_model(start, vocab_size=len(tokenizer), tokenizer=tokenizer)
    model.save_pretrained(tmp / "start")
    tokenizer.save_pretrained(tmp / "start")
    words = sorted({w for line in corpus["test"]["text"] for w in line.split()})
    mc_task(tmp / "mc", words=words, n=12)
    data = {
        **TINY,
        "model": {"path": str(tmp / "start")},
        "data": {**TINY["data"], "tokenizer": {"kind": "model"}},
        "train": None,
        "prune": {"arms": MIXED_ARMS},
        "finetune": {"max_steps": 2, "batch_size": 4},
        "evaluate": {"speed": False, "tasks": ["./mc"]},
        "export": {"gguf": {"type": "f32", "vocab": False}},
    }
    recipe = tmp / "mixed.yaml"
    recipe.write_text(yaml.safe_dump(data))
    single = invoke(recipe, "--output", tmp / "one", "--quiet", "--threads", 1)
    assert single.exit_code == 0, single.output
    launched = torchrun(recipe, "--output", tmp / "two", "--threads", 1, "--quiet", cwd=tmp, guard=tmp / "two")
    assert launched.returncode == 0, failure(launched)
    one, two = (json.loads((tmp / run / "results.json").read_text()) for run in ("one", "two"))
    return tmp, one, two


def test_rounds_allocation_tasks_and_export_under_two_processes_match_one(mixed_runs):
    tmp, one, two = mixed_runs
    assert two["baseline"]["perplexity"] == pytest.approx(one["baseline"]["perplexity"], rel=1e-4)
    assert two["baseline"]["tasks"]["tiny_mc"]["acc"] == one["baseline"]["tasks"]["tiny_mc"]["acc"]
    mlp, mixed, allocated = two["arms"]
    assert [len(arm["per_round"]) for arm in (mlp, mixed)] == [2, 2]
    assert mixed["heads_removed"] == 2 and mixed["channels_removed"] == 16 and mlp["channels_removed"] == 32
    kept = allocated["allocation"][0]["kept"]["mlp"]
    assert allocated["allocation"][0]["strategy"] == "sensitivity" and kept["min"] < kept["max"]  # uneven widths
    for a, b in zip(one["arms"], two["arms"], strict=True):
        assert [b[k] for k in ("name", "heads_removed", "channels_removed")] == [
            a[k] for k in ("name", "heads_removed", "channels_removed")]  # fmt: skip
        assert b.get("removed") == a.get("removed")
        assert b.get("per_round") == a.get("per_round")
        assert [_untimed(x) for x in b.get("allocation") or []] == [_untimed(x) for x in a.get("allocation") or []]
        assert b["pruned"]["perplexity"] == pytest.approx(a["pruned"]["perplexity"], rel=1e-4)
        assert b["pruned"]["tasks"]["tiny_mc"]["acc"] == a["pruned"]["tasks"]["tiny_mc"]["acc"]
        assert b["finetuned"]["tasks"]["tiny_mc"]["samples"] == 12  # fine-tuned by both processes
    assert list(two["gguf"]) == ["baseline"] + [a["name"] for a in two["arms"]]
    for name, row in two["gguf"].items():  # same shapes, so the same size; the weights were fine-tuned apart
        theirs = one["gguf"][name]
        assert (row["arch"], row["type"], row["size_bytes"]) == (theirs["arch"], theirs["type"], theirs["size_bytes"])
        assert (tmp / "two" / row["path"]).stat().st_size == row["size_bytes"]
    state = json.loads((tmp / "two" / "state.json").read_text())
    assert state["finished"] == ["train", "score", "prune", "finetune", "evaluate", "export", "report"]
    assert [p.relative_to(tmp / "two") for p in (tmp / "two").rglob("results.json")] == [Path("results.json")]
    assert not list((tmp / "two").rglob(".*"))  # no temp file of a competing write


def _untimed(found: dict) -> dict:
    return {k: v for k, v in found.items() if k != "seconds"}
