"""The recipe's evaluate.tasks / prompts end to end, against sinv-prune eval and lm-eval's own simple_evaluate."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from click.testing import CliRunner

pytest.importorskip("lm_eval", reason='lm-eval is not installed (pip install "sinv_prune[eval]")')

import sinv_prune  # noqa: E402
from sinv_prune import data as data_mod  # noqa: E402
from sinv_prune.cli import main  # noqa: E402
from tests.test_lmeval import fake_wikitext, mc_task  # noqa: E402

SYNTHETIC = {"seed": 0, "num_train": 200, "num_valid": 30, "num_test": 30}
RECIPE = {
    "name": "tasks",
    "seed": 0,
    "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
    "data": {"synthetic": SYNTHETIC, "tokenizer": {"kind": "word"}, "seq_len": 32},
    "train": {"max_steps": 6, "batch_size": 8, "learning_rate": 0.003},
    "score": {"batches": 2, "batch_size": 4},
    "prune": {"arms": [{"criterion": "magnitude", "amount": 2}]},
    "finetune": {"max_steps": 2, "batch_size": 8},
    "evaluate": {"speed": False, "prompts": ["lo", "li"]},
}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def corpus_words() -> list[str]:
    lines = data_mod.synthetic_corpus(**SYNTHETIC)["test"]["text"]
    return sorted({w for line in lines for w in line.split()})


@pytest.fixture(scope="module")
def fake_wikitext_dir(tmp_path_factory):
    """SINV_PRUNE_WIKITEXT at a small WikiText-like test.txt (40 last-word items) for this module's tests."""
    tmp = tmp_path_factory.mktemp("wikitext")
    fake_wikitext(tmp / "test.txt")
    patch = pytest.MonkeyPatch()
    patch.setenv("SINV_PRUNE_WIKITEXT", str(tmp))
    yield tmp
    patch.undo()


@pytest.fixture(scope="module")
def run(tmp_path_factory, fake_wikitext_dir):
    tmp = tmp_path_factory.mktemp("tasks")
    task_dir = mc_task(tmp / "mc", words=corpus_words(), n=24)
    recipe = tmp / "tasks.yaml"
    tasks = ["mc", "wikitext_lastword"]
    recipe.write_text(yaml.safe_dump({**RECIPE, "evaluate": {**RECIPE["evaluate"], "tasks": tasks}}))
    result = invoke(recipe, "--output", tmp / "out", "--quiet")
    assert result.exit_code == 0, result.output
    return tmp / "out", task_dir


def test_recipe_eval_command_and_simple_evaluate_give_the_same_accuracy(run, tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    out, task_dir = run
    recipe_acc = json.loads((out / "results.json").read_text())["baseline"]["tasks"]["tiny_mc"]["acc"]
    model = sinv_prune.from_pretrained(out / "base").eval()
    tokenizer = data_mod.load_model_tokenizer(out / "base")
    own = simple_evaluate(
        model=HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8),
        tasks=["tiny_mc"],
        num_fewshot=0,
        task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
    )
    saved = tmp_path / "eval.json"
    cli = invoke("eval", out / "base", "--tasks", task_dir, "--json", saved, "--batch-size", "3")
    assert cli.exit_code == 0, cli.output
    assert "|tiny_mc|" in cli.output.replace(" ", "")  # lm-eval's own table
    cli_acc = json.loads(saved.read_text())["tasks"]["tiny_mc"]["acc"]
    assert recipe_acc == own["results"]["tiny_mc"]["acc,none"] == cli_acc
    again = invoke("eval", out / "base", "--tasks", task_dir, "--json", saved)
    assert again.exit_code == 2 and "--overwrite" in again.output


def test_every_model_has_tasks_generations_and_pins(run):
    out, _ = run
    results = json.loads((out / "results.json").read_text())
    arm = results["arms"][0]
    for evaluation in (results["baseline"], arm["pruned"], arm["finetuned"]):
        metrics = evaluation["tasks"]["tiny_mc"]
        assert 0 <= metrics["acc"] <= 1 and metrics["acc_stderr"] > 0 and metrics["samples"] == 24
        assert [g["prompt"] for g in evaluation["generations"]] == ["lo", "li"]
        assert all(0 < g["new_tokens"] <= 32 for g in evaluation["generations"])
    for evaluation in (results["baseline"], arm["pruned"], arm["finetuned"]):
        lastword = evaluation["tasks"]["wikitext_lastword"]
        assert lastword["samples"] == 40 and 0 <= lastword["acc"] <= 1 and lastword["perplexity"] > 1
    pins = results["run"]["lm_eval"]
    assert pins["lm_eval_version"] and pins["num_fewshot"] == 0 and pins["limit"] is None
    assert pins["tasks"]["tiny_mc"]["version"] == 1.0 and pins["builds"]["wikitext_lastword"]["items"] == 40
    built = list((out / "tasks").glob("wikitext_lastword-*/build.json"))
    assert len(built) == 1 and pins["task_dirs"][1] == str(built[0].parent)  # built into the run directory
    report = (out / "report.md").read_text()
    assert "| arm | stage | params | tiny_mc (acc) | wikitext_lastword (acc) | mean |" in report
    base = results["baseline"]["tasks"]
    mean = (base["tiny_mc"]["acc"] + base["wikitext_lastword"]["acc"]) / 2
    assert f"| baseline | - | {results['baseline']['params']:,} | " in report and f"| {mean:.4f} |" in report
    assert f"lm-eval {pins['lm_eval_version']}, 0-shot" in report
    assert "## Generations" in report and f"- `{arm['name']} (fine-tuned)`: " in report
    assert (out / "plots" / "accuracy_vs_params.png").is_file()


def test_greedy_generations_are_reproducible(run):
    from sinv_prune.pipeline.generations import greedy_continuations

    out, _ = run
    model = sinv_prune.from_pretrained(out / "base")
    tokenizer = data_mod.load_model_tokenizer(out / "base")
    saved = json.loads((out / "results.json").read_text())["baseline"]["generations"]
    assert greedy_continuations(model, tokenizer, ["lo", "li"]) == saved


@pytest.mark.parametrize(
    "tasks, message",
    [
        (["arc_eazy"], "error: evaluate.tasks[0]: unknown lm-eval task 'arc_eazy'; did you mean arc_easy"),
        (["./nowhere"], "error: evaluate.tasks[0]: no such task directory"),
    ],
)
def test_bad_tasks_fail_in_preflight(tmp_path, tasks, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "evaluate": {"tasks": tasks}}))
    result = invoke(recipe, "--output", tmp_path / "out")
    assert result.exit_code == 2 and result.output.startswith(message), result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_tasks_without_lm_eval_fail_in_preflight_with_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "evaluate": {"tasks": ["wikitext_lastword"]}}))
    result = invoke(recipe, "--output", tmp_path / "out")
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert result.output == 'error: evaluate.tasks: lm-eval is not installed; run: pip install "sinv_prune[eval]"\n'
    cli = invoke("eval", tmp_path, "--tasks", "wikitext_lastword")
    assert cli.exit_code == 2 and "pip install" in cli.output


def test_dry_run_counts_the_last_word_task_and_the_generations(tmp_path, fake_wikitext_dir):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "evaluate": {"tasks": ["wikitext_lastword"], "limit": 10}}))
    result = invoke(recipe, "--output", tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "evaluate tasks (lm-eval)" in result.output and "3 models x wikitext_lastword 10 items" in result.output
    assert "3 models x 3 prompts x 32 tokens" in result.output and not (tmp_path / "out").exists()


def test_eval_perplexity_measures_the_wikitext_test_text_as_a_recipe_does(run, fake_wikitext_dir, tmp_path):
    from sinv_prune.pipeline.evaluation import perplexity

    out, _ = run
    saved = tmp_path / "p.json"
    cli = invoke("eval", out / "base", "--perplexity", "--max-tokens", 300, "--json", saved)
    assert cli.exit_code == 0, cli.output
    ppl = json.loads(saved.read_text())["perplexity"]
    assert "tasks" not in json.loads(saved.read_text()) and f"perplexity: {ppl['perplexity']:.3f}" in cli.output
    assert (ppl["seq_len"], ppl["stride"], ppl["tokens"]) == (64, 32, 299)  # n_positions 64: windows of 64
    model = sinv_prune.from_pretrained(out / "base")
    tokenizer = data_mod.load_model_tokenizer(out / "base")
    ids = data_mod.token_ids((fake_wikitext_dir / "test.txt").read_text().splitlines(), tokenizer)
    direct = perplexity(model, ids, seq_len=64, stride=32, max_tokens=300)
    assert ppl["perplexity"] == pytest.approx(direct["perplexity"], rel=1e-6)


def test_a_masked_lm_recipe_with_tasks_fails_in_preflight(tmp_path):
    bert = {"architecture": "bert", "config": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32,
                                               "intermediate_size": 48}}  # fmt: skip
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "model": bert, "finetune": None, "evaluate": {"tasks": ["mc"]}}))
    result = invoke(recipe, "--output", tmp_path / "out")
    assert result.exit_code == 2 and not (tmp_path / "out").exists()
    assert (
        result.output == "error: evaluate.tasks: lm-eval tasks score causal LMs; this recipe's model is a masked LM\n"
    )


def test_tasks_on_runs_the_tasks_on_the_fine_tuned_models_only(tmp_path):
    task_dir = mc_task(tmp_path / "mc", words=corpus_words(), n=24)
    arms = [{"criterion": "magnitude", "amount": 2}, {"control": True}]
    evaluate = {**RECIPE["evaluate"], "tasks": ["mc"], "tasks_on": ["finetuned"]}
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "prune": {"arms": arms}, "evaluate": evaluate}))
    dry = invoke(recipe, "--output", tmp_path / "dry", "--dry-run")
    assert dry.exit_code == 0 and "2 models x tasks" in dry.output, dry.output  # not the 4 without tasks_on
    result = invoke(recipe, "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text())
    pruned_arm, control = results["arms"]
    for evaluation in (results["baseline"], pruned_arm["pruned"], control["pruned"]):
        assert "tasks" not in evaluation and len(evaluation["generations"]) == 2  # generations still run
    for arm in (pruned_arm, control):  # each fine-tuned model's accuracy is the one `sinv-prune eval` measures
        saved = tmp_path / f"{arm['name']}.json"
        cli = invoke("eval", out / arm["model_dir"], "--tasks", task_dir, "--json", saved, "--batch-size", "8")
        assert cli.exit_code == 0, cli.output
        assert arm["finetuned"]["tasks"]["tiny_mc"]["acc"] == json.loads(saved.read_text())["tasks"]["tiny_mc"]["acc"]
    assert results["run"]["lm_eval"]["tasks"]["tiny_mc"]["version"] == 1.0
    report = (out / "report.md").read_text()
    assert "| arm | stage | params | tiny_mc (acc) | mean |" in report
    assert f"| baseline | - | {results['baseline']['params']:,} | - | - |" in report
    acc = control["finetuned"]["tasks"]["tiny_mc"]["acc"]
    assert f"| {control['name']} | fine-tuned | {control['finetuned']['params']:,} | {acc:.4f} ± " in report
    assert (out / "plots" / "accuracy_vs_params.png").is_file()


@pytest.mark.parametrize(
    "tasks_on, message",
    [
        ([], "evaluate.tasks_on: List should have at least 1 item"),
        (["tuned"], "evaluate.tasks_on[0]: Input should be 'baseline', 'pruned' or 'finetuned'"),
        (["pruned", "pruned"], "evaluate.tasks_on: pruned named twice"),
    ],
)
def test_bad_tasks_on_is_a_one_line_usage_error(tmp_path, tasks_on, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "evaluate": {"tasks": ["wikitext_lastword"], "tasks_on": tasks_on}}))
    result = invoke(recipe, "--output", tmp_path / "out")
    assert result.exit_code == 2 and result.output.startswith("error: ") and message in result.output, result.output
    assert len(result.output.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
