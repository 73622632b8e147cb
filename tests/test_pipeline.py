"""End to end: a tiny recipe through the CLI, resume after an interruption, and bad input."""

from __future__ import annotations

import json

import pytest
import yaml
from click.testing import CliRunner
from transformers import TrainerCallback

import sinv_prune
from sinv_prune.cli import main
from sinv_prune.pipeline import stages as pipeline
from sinv_prune.pipeline.recipe import validate_recipe
from sinv_prune.scoring.criteria import StoredScores

TINY = {
    "name": "tiny",
    "seed": 0,
    "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
    "data": {
        "synthetic": {"seed": 0, "num_train": 200, "num_valid": 30, "num_test": 30},
        "tokenizer": {"kind": "word"},
        "seq_len": 32,
        "eval_stride": 16,
    },
    "train": {"max_steps": 6, "batch_size": 8, "learning_rate": 0.003, "tracking": {"every_n_steps": 2}},
    "score": {"batches": 2, "batch_size": 4},
    "prune": {
        "arms": [
            {"criterion": "sinv_early", "amount": 2},
            {"criterion": "random", "amount": 2, "seed": 1},
            {"criterion": "magnitude", "amount": 2},
            {"criterion": "taylor", "amount": 2},
        ]
    },
    "finetune": {"max_steps": 2, "batch_size": 8},
    "evaluate": {"speed_repeats": 2, "speed_batch_size": 2},
}


MISTRAL = {
    "architecture": "mistral",
    "config": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
               "intermediate_size": 48},
}  # fmt: skip


def recipe_file(tmp_path, data=TINY):
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("run")
    result = invoke(recipe_file(tmp), "--output", tmp / "out", "--quiet")
    assert result.exit_code == 0, result.output
    return tmp / "out", result.output


def test_cli_run_writes_results_report_and_plots(finished_run):
    out, console = finished_run
    results = json.loads((out / "results.json").read_text())
    assert results["baseline"]["params"] > 0 and results["baseline"]["perplexity"] > 1
    assert [a["name"] for a in results["arms"]] == [
        "sinv_early-2-global", "random-2-global", "magnitude-2-global", "taylor-2-global"]  # fmt: skip
    for arm in results["arms"]:
        assert arm["heads_removed"] == 2
        assert arm["params"] < results["baseline"]["params"]
        assert arm["finetuned"]["perplexity"] == arm["perplexity"]
        assert sum(len(v) for v in arm["removed"].values()) == 2
    report = (out / "report.md").read_text()
    assert report.count("\n| ") == 2 + 1 + len(results["arms"])  # header, separator, baseline, arms
    assert (out / "plots" / "perplexity_vs_params.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "plots" / "C_Q_curves.png").exists()
    assert (out / "trace.jsonl").exists() and (out / "recipe.yaml").exists() and (out / "run.log").exists()
    assert "baseline" in console and "taylor" in console  # the summary table


def test_no_trainer_checkpoints_are_left_after_a_run(finished_run):
    out, _ = finished_run
    assert not list(out.rglob("checkpoint-*"))
    assert not (out / "checkpoints").exists()
    for arm in (out / "arms").iterdir():
        assert sorted(p.name for p in arm.iterdir()) == ["finetuned", "pruned"]


def test_keep_checkpoints_keeps_them(tmp_path):
    one_arm = {
        **TINY,
        "train": {**TINY["train"], "tracking": None},
        "prune": {"arms": [{"criterion": "magnitude", "amount": 2}]},
    }
    result = invoke(recipe_file(tmp_path, one_arm), "--output", tmp_path / "out", "--quiet", "--keep-checkpoints")
    assert result.exit_code == 0, result.output
    kept = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("checkpoint-*"))
    assert kept == ["arms/magnitude-2-global/checkpoints/checkpoint-2", "checkpoints/train/checkpoint-6"]


class StopAfterFirstSave(TrainerCallback):
    """Interrupt a Trainer right after it wrote its first checkpoint (as a kill would)."""

    def on_save(self, args, state, control, **kwargs):
        raise KeyboardInterrupt


def test_resume_inside_a_finetune_continues_from_its_checkpoint(tmp_path, monkeypatch):
    data = {**TINY, "finetune": {**TINY["finetune"], "save_every": 1}}
    real_trainer = pipeline.run_trainer

    def second_arm_stops(model, tokenizer, train, evals, spec, output_dir, **kwargs):
        if output_dir.parent.name == "random-2-global":
            kwargs["callbacks"] = [StopAfterFirstSave()]
        return real_trainer(model, tokenizer, train, evals, spec, output_dir, **kwargs)

    monkeypatch.setattr(pipeline, "run_trainer", second_arm_stops)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_recipe(validate_recipe(data), tmp_path / "out", quiet=True)
    monkeypatch.undo()
    arms = tmp_path / "out" / "arms"
    assert not (arms / "sinv_early-2-global" / "checkpoints").exists()  # finished: its checkpoints are gone
    assert [p.name for p in (arms / "random-2-global" / "checkpoints").iterdir()] == ["checkpoint-1"]  # still needed

    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out", "--quiet", "--resume")
    assert result.exit_code == 0, result.output
    assert "resuming training from" in (tmp_path / "out" / "run.log").read_text()
    state = json.loads((tmp_path / "out" / "state.json").read_text())
    assert state["arms"]["random-2-global"]["finetune"]["steps"] == 2
    assert not list((tmp_path / "out").rglob("checkpoint-*"))


def test_each_arm_reloads_with_the_claimed_parameter_count(finished_run):
    out, _ = finished_run
    results = json.loads((out / "results.json").read_text())
    for arm in results["arms"]:
        model = sinv_prune.from_pretrained(out / arm["model_dir"])
        assert sinv_prune.count_parameters(model) == arm["params"]
        removed = {int(k): v for k, v in model.config.sinv_prune["pruned_heads"].items()}
        assert removed == {int(k): v for k, v in arm["removed"].items()}


def test_arms_report_their_layout(finished_run):
    out, _ = finished_run
    results = json.loads((out / "results.json").read_text())
    assert [a["layout"] for a in results["arms"]] == ["q_per_group"] * len(results["arms"])  # the default
    assert results["run"]["gqa"] is False  # GPT-2: every layout is the same cut, so report.md has no column
    lines = (out / "report.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| arm "))
    assert "layout" not in [c.strip() for c in header.split("|")]


def test_arms_report_what_they_removed(finished_run):
    out, _ = finished_run
    results = json.loads((out / "results.json").read_text())
    assert {(a["unit"], a["parts"]) for a in results["arms"]} == {("heads", None)}
    assert all(a["channels_removed"] == a["layers_removed"] == 0 and a["heads_removed"] > 0 for a in results["arms"])
    lines = (out / "report.md").read_text().splitlines()
    header = [c.strip() for c in next(line for line in lines if line.startswith("| arm ")).split("|")]
    cells = {line.split("|")[1].strip(): line.split("|")[header.index("removed")].strip()
             for line in lines if line.startswith("| ") and not line.startswith(("| arm ", "| ---"))}  # fmt: skip
    assert cells == {"baseline": "-", **{a["name"]: "2 heads" for a in results["arms"]}}


def test_resume_after_interruption_gives_the_same_results(finished_run, tmp_path, monkeypatch):
    out_full, _ = finished_run
    recipe = validate_recipe(TINY)

    def interrupted(run):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "stage_finetune", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_recipe(recipe, tmp_path / "out", quiet=True)
    state = json.loads((tmp_path / "out" / "state.json").read_text())
    assert state["finished"] == ["train", "score", "prune"]
    monkeypatch.undo()

    result = invoke(recipe_file(tmp_path), "--output", tmp_path / "out", "--quiet", "--resume")
    assert result.exit_code == 0, result.output
    full = json.loads((out_full / "results.json").read_text())
    resumed = json.loads((tmp_path / "out" / "results.json").read_text())
    for a, b in zip(full["arms"], resumed["arms"], strict=True):
        assert a["removed"] == b["removed"]
        assert a["params"] == b["params"]
        assert a["perplexity"] == pytest.approx(b["perplexity"], rel=1e-6)
    assert full["baseline"]["perplexity"] == pytest.approx(resumed["baseline"]["perplexity"], rel=1e-6)


def test_existing_output_is_not_overwritten(finished_run):
    out, _ = finished_run
    before = (out / "results.json").read_text()
    result = invoke(out.parent / "tiny.yaml", "--output", out, "--quiet")
    assert result.exit_code == 2
    assert "--overwrite" in result.output
    assert (out / "results.json").read_text() == before


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("model: [unclosed\n", "malformed YAML"),
        (yaml.safe_dump({**TINY, "colour": "red"}), "colour: unknown key"),
        (yaml.safe_dump({**TINY, "seed": "zero"}), "seed: Input should be a valid integer"),
        (yaml.safe_dump({**TINY, "prune": {"arms": [{"criterion": "vibes", "amount": 2}]}}), "criterion"),
        (yaml.safe_dump({**TINY, "prune": {"arms": [{"criterion": "random", "amount": 99}]}}), "99 heads requested"),
        (yaml.safe_dump({**TINY, "model": {"architecture": "t5"}}), "unknown architecture"),
        (yaml.safe_dump({**TINY, "prune": {"arms": [{"parts": [{"criterion": "random", "amount": 99}]}]}}),
         "prune.arms[0].parts[0].amount: 99 heads requested"),
        (yaml.safe_dump({**TINY, "prune": {"arms": [{"criterion": "random", "unit": "mlp", "amount": 2,
                                                      "layout": "auto"}]}}),
         "prune.arms[0]: 'layout' is for unit heads only, not mlp"),
        (yaml.safe_dump({**TINY, "data": {"files": {"test": "missing.txt"}, "tokenizer": {"kind": "word"}}}),
         "does not exist"),
        (yaml.safe_dump({**TINY, "model": MISTRAL, "train": {**TINY["train"], "symmetry_breaking": {}}}),
         "train.symmetry_breaking: mistral: q_proj, v_proj have no bias"),
        (yaml.safe_dump({**TINY, "train": {**TINY["train"], "symmetry_breaking": {"b_q": None, "b_v": None}}}),
         "train.symmetry_breaking: b_q and b_v are both null"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line_and_no_output(tmp_path, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    result = invoke(path, "--output", tmp_path / "out")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0]
    assert not (tmp_path / "out").exists()


def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    result = invoke(recipe_file(tmp_path), "--output", tmp_path / "out", "--dry-run")
    assert result.exit_code == 0
    assert "2 layers, 8 heads" in result.output and "arm taylor-2-global" in result.output
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny.yaml"]


def test_dry_run_estimates_every_stage_and_a_total(tmp_path):
    result = invoke(recipe_file(tmp_path), "--output", tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "estimate" in result.output and "probe on cpu" in result.output
    stages = [line.split()[0:2] for line in result.output.splitlines() if line.startswith("  ")]
    names = [" ".join(s) if s[0] in ("score", "prune", "finetune") else s[0] for s in stages]
    arms = [a["criterion"] + "-2-global" for a in TINY["prune"]["arms"]]
    assert names == [
        "train:", "finetune:",  # the optimizers, with their defaults filled in
        "arm", "arm", "arm", "arm",  # the plan
        "start", "train", "score magnitude", "score taylor",
        *(f"prune {a}" for a in arms), *(f"finetune {a}" for a in arms),
        "evaluate", "generations", "report", "total"]  # fmt: skip
    assert "warning" not in result.output


def test_dry_run_warns_when_the_output_exists_and_leaves_it_alone(finished_run):
    out, _ = finished_run
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    result = invoke(out.parent / "tiny.yaml", "--output", out, "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"warning: {out} exists" in result.output and "--overwrite" in result.output and "--resume" in result.output
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


@pytest.mark.parametrize("model_path", ["./no-such-model", "models/sub/no-such-model", "present/no-such-model", "ABS"])
def test_a_missing_local_model_path_is_named_as_a_directory(tmp_path, model_path):
    (tmp_path / "present").mkdir()  # `present/name` is a path here, not a Hub repo id
    model_path = str(tmp_path / "gone") if model_path == "ABS" else model_path
    data = {
        **TINY,
        "model": {"path": model_path},
        "train": None,
        "prune": {"arms": [{"criterion": "magnitude", "amount": 2}]},
    }
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.path: no such directory: ")
    assert lines[0].endswith(model_path.removeprefix("./")) and "repo" not in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_recipe_path_that_is_a_directory_says_so(tmp_path):
    result = invoke(tmp_path, "--output", tmp_path / "out")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0] == f"error: {tmp_path}: is a directory; give a recipe file (a .yaml inside it)"
    assert not (tmp_path / "out").exists()


UNITS = {
    **TINY,
    "train": {"max_steps": 2, "batch_size": 8, "learning_rate": 0.003},
    "prune": {
        "arms": [
            {"criterion": "magnitude", "unit": "mlp", "amount": 0.25, "mode": "uniform", "multiple": 8},
            {"criterion": "random", "unit": "layers", "amount": 1, "seed": 1},
            {
                "parts": [{"criterion": "taylor", "amount": 2}, {"criterion": "taylor", "unit": "mlp", "amount": 64}],
            },
        ]
    },
    "finetune": {"max_steps": 2, "batch_size": 8, "learning_rate": 0.003, "distill": {"teacher": "base"}},
    "evaluate": {"speed": False},
}


def test_mlp_layer_and_mixed_arms_run_end_to_end(tmp_path):
    """Each arm removes what it says, distils from the unpruned model, reloads with the claimed parameter count,
    and the report names it."""
    data = UNITS
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    mlp, layers, mixed = results["arms"]
    assert (mlp["name"], mlp["unit"], mlp["heads_removed"]) == ("magnitude-mlp-0.25-uniform", "mlp", 0)
    assert mlp["channels_removed"] == 0.25 * 2 * 128  # gpt2's MLP: 4 x n_embd channels per layer
    assert (layers["name"], layers["unit"], layers["layers_removed"]) == ("random-layers-1-global", "layers", 1)
    assert (mixed["unit"], mixed["heads_removed"], mixed["channels_removed"]) == ("heads+mlp", 2, 64)
    assert [p["unit"] for p in mixed["parts"]] == ["heads", "mlp"]
    for arm in results["arms"]:
        model = sinv_prune.from_pretrained(tmp_path / "out" / arm["model_dir"])
        assert sinv_prune.count_parameters(model) == arm["params"] < results["baseline"]["params"]
        assert arm["model_dir"].endswith("finetuned") and arm["distill"]["teacher"] == "base"
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| 64 channels |" in report and "2 heads + 64 channels" in report


def test_arm_pruner_maps_every_part_onto_the_pruner(monkeypatch):
    """Heads arms get a HeadPruner; other arms one ``Part`` per part with the part's keys, the arm's compensation."""
    made = {}

    def part(unit, criterion, amount, **keys):
        return {"unit": unit, "criterion": criterion, "amount": amount, **keys}

    def pruner(parts, **keys):
        made.update(parts=parts, **keys)
        return "pruner"

    monkeypatch.setattr(pipeline, "Pruner", pruner)
    monkeypatch.setattr(pipeline, "Part", part)
    arms = [
        {"criterion": "magnitude", "amount": 2, "mode": "uniform", "layout": "kv_groups", "rounds": 2},
        {"parts": [{"criterion": "magnitude", "amount": 2, "min_heads_per_layer": 0},
                   {"criterion": "random", "unit": "mlp", "amount": 0.5, "multiple": 8, "seed": 3}],
         "compensate": {"method": "lsq", "ridge": 0.1}},
    ]  # fmt: skip
    recipe = validate_recipe({**TINY, "prune": {"arms": arms, "allow_empty_layers": True}})
    heads = pipeline.arm_pruner(None, recipe.prune.arms[0])
    (part,) = heads.parts
    assert isinstance(heads, sinv_prune.HeadPruner) and part.criterion.name == "magnitude"
    assert (part.amount, part.mode, part.layout, heads.rounds) == (2, "uniform", "kv_groups", 2)
    stored = StoredScores("magnitude", "heads", [[1.0, 2.0]], {"note": 1})
    channels = StoredScores("random", "mlp", [[0.5] * 4])  # by name only once criteria take a unit
    assert pipeline.arm_pruner(None, recipe.prune.arms[1], [stored, channels]) == "pruner"
    first, second = made["parts"]
    assert first == {"unit": "heads", "criterion": stored, "amount": 2, "mode": "global", "seed": 0,
                     "layout": "q_per_group", "min_per_layer": 0}  # fmt: skip
    assert {k: second[k] for k in ("unit", "amount", "mode", "seed", "multiple")} == {
        "unit": "mlp", "amount": 0.5, "mode": "global", "seed": 3, "multiple": 8}  # fmt: skip
    assert second["criterion"] is channels and channels.units == ("mlp",) and "min_per_layer" not in second
    assert (made["rounds"], made["compensate"]) == (1, "lsq")
    assert made["compensation_options"] == {"add_bias": False, "ridge": 0.1, "holdout": 0.125, "precision": "float32",
                                            "target": "output", "progress": True}  # fmt: skip  # no run: not quiet
    assert stored.compute(None) == [[1.0, 2.0]] and stored.report() == {"note": 1}
