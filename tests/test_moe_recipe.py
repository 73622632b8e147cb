"""The mixture-of-experts recipe path: a tiny Qwen3-MoE from scratch, its experts pruned, routing statistics
before and after in results.json and report.md, the load-balancing loss in training, preflight refusals."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from click.testing import CliRunner

from sinv_prune.cli import main
from sinv_prune.pipeline.recipe import SCRATCH_ARCHITECTURES, validate_recipe
from sinv_prune.pipeline.starting_model import build_model

TINY_MOE = {
    "name": "tiny-moe",
    "seed": 0,
    "model": {
        "architecture": "qwen3_moe",
        "config": {
            "num_hidden_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 8,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "router_aux_loss_coef": 0.01,
            "max_position_embeddings": 64,
        },
    },  # fmt: skip
    "data": {
        "synthetic": {"seed": 0, "num_train": 120, "num_valid": 20, "num_test": 20},
        "tokenizer": {"kind": "word"},
        "seq_len": 32,
    },
    "train": {"max_steps": 3, "batch_size": 8, "learning_rate": 0.003, "tracking": {"every_n_steps": 1}},
    "score": {"batches": 1, "batch_size": 4},
    "prune": {"arms": [{"criterion": "random", "unit": "experts", "amount": 0.5, "seed": 1}]},
    "finetune": {"max_steps": 2, "batch_size": 8},
    "evaluate": {"speed": False, "prompts": []},
}


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def recipe_file(tmp_path, data=TINY_MOE):
    path = tmp_path / "tiny-moe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moe")
    result = invoke(recipe_file(tmp), "--output", tmp / "out", "--quiet")
    assert result.exit_code == 0, result.output
    return tmp / "out"


def test_moe_recipe_runs_and_records_routing_before_and_after(moe_run):
    results = json.loads((moe_run / "results.json").read_text())
    base = results["baseline"]["routing"]
    assert base["num_experts"] == 8 and base["top_k"] == 2 and sorted(base["layers"]) == ["0", "1"]
    for row in base["layers"].values():
        assert sum(row["counts"]) == base["tokens"] * 2  # every token picks top_k experts
        assert row["removed"] == [] and abs(sum(row["share"]) - 1) < 1e-9
    (arm,) = results["arms"]
    assert arm["experts_removed"] == 8  # half of 2 x 8, the same count in every layer
    removed = {layer: experts for layer, experts in arm["removed_experts"].items()}
    assert sorted(removed) == ["0", "1"] and all(len(e) == 4 for e in removed.values())
    for stage in ("pruned", "finetuned"):
        routing = arm[stage]["routing"]
        assert routing["tokens"] == base["tokens"] and routing["num_experts"] == 8  # original numbering
        for layer, row in routing["layers"].items():
            assert row["removed"] == removed[layer]
            assert [row["counts"][e] for e in removed[layer]] == [0] * 4
            assert sum(row["counts"]) == routing["tokens"] * 2
            assert all(row["counts"][e] >= 0 for e in range(8))
    assert arm["params"] < results["baseline"]["params"]
    assert results["routing_plots"] == {arm["name"]: f"plots/routing_{arm['name']}.png"}
    assert (moe_run / results["routing_plots"][arm["name"]]).stat().st_size > 0
    report = (moe_run / "report.md").read_text()
    assert "## Expert routing" in report and f"(plots/routing_{arm['name']}.png)" in report
    assert "| 8 experts |" in report  # the summary table's removed column


def test_moe_tracking_measures_heads_only(moe_run):
    lines = [json.loads(line) for line in (moe_run / "trace.jsonl").read_text().splitlines()]
    measured = [line for line in lines if "C_Q" in line]
    assert measured and all(len(line["C_Q"]) == 2 and len(line["C_Q"][0]) == 4 for line in measured)
    assert all(value is None for line in measured for value in line["C_FF"])  # no dense MLP in a MoE layer


def test_scratch_moe_trains_with_the_load_balancing_loss():
    recipe = validate_recipe(copy.deepcopy(TINY_MOE))
    model = build_model(recipe, vocab_size=50)
    assert model.config.output_router_logits is True  # the default for a MoE from scratch
    ids = torch.randint(50, (2, 16))
    out = model(input_ids=ids, labels=ids)  # what transformers' Trainer minimises: outputs.loss
    lm = model.loss_function(out.logits, ids, model.config.vocab_size)
    assert out.aux_loss is not None and out.aux_loss > 0
    assert torch.allclose(out.loss, lm + 0.01 * out.aux_loss)
    off = copy.deepcopy(TINY_MOE)
    off["model"]["config"]["output_router_logits"] = False
    assert build_model(validate_recipe(off), vocab_size=50).config.output_router_logits is False


@pytest.mark.parametrize("architecture", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_every_moe_architecture_builds_from_a_recipe(architecture):
    assert architecture in SCRATCH_ARCHITECTURES
    experts = "num_local_experts" if architecture == "mixtral" else "num_experts"
    config = {"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
              "intermediate_size": 16, experts: 4, "num_experts_per_tok": 2}  # fmt: skip
    if architecture in ("qwen3_moe", "qwen2_moe"):
        config.update(moe_intermediate_size=16, shared_expert_intermediate_size=16)
    if architecture == "qwen3_moe":
        del config["shared_expert_intermediate_size"]
    data = copy.deepcopy(TINY_MOE)
    data["model"] = {"architecture": architecture, "config": config}
    model = build_model(validate_recipe(data), vocab_size=40)
    from sinv_prune.pipeline.routing import routing_statistics

    stats = routing_statistics(model, torch.arange(40).repeat(2), seq_len=16)
    assert stats["num_experts"] == 4 and sum(stats["layers"]["0"]["counts"]) == stats["tokens"] * 2


@pytest.mark.parametrize(("amount", "said"), [(13, "13 experts requested"), (0.9, "0.9 of the experts (14)")])
def test_too_many_experts_is_a_one_line_preflight_error(tmp_path, amount, said):
    data = copy.deepcopy(TINY_MOE)
    data["prune"]["arms"][0]["amount"] = amount
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert result.output.strip().count("\n") == 0
    assert result.output.startswith("error: prune.arms[0].amount: " + said)
    assert "at most 12 can go" in result.output and "num_experts_per_tok" in result.output
    assert not (tmp_path / "out").exists()


def test_dry_run_names_the_experts_and_counts_the_routing_pass(tmp_path):
    result = invoke(recipe_file(tmp_path), "--dry-run", "--threads", "1")
    assert result.exit_code == 0, result.output
    assert "16 experts in 2 MoE layers (top-2)" in result.output
    assert "+ expert routing" in result.output


def test_routing_statistics_use_the_original_numbering_after_layers_and_experts_go():
    import sinv_prune
    from sinv_prune.pipeline.routing import routing_statistics

    data = copy.deepcopy(TINY_MOE)
    data["model"]["config"]["num_hidden_layers"] = 3
    model = build_model(validate_recipe(data), vocab_size=40).eval()
    ids = torch.arange(40).repeat(3)
    before = routing_statistics(model, ids, seq_len=20, batch_size=2)
    sinv_prune.prune(model, {"layers": [1], "experts": {2: [0, 7]}})  # then layer 1 of the pruned model is original 2
    assert model.config.output_router_logits is True  # kept: the load-balancing loss gets padded router logits
    with torch.no_grad():
        assert model(ids[None, :20], labels=ids[None, :20]).aux_loss.isfinite()
    after = routing_statistics(model, ids, seq_len=20, batch_size=2)
    assert sorted(before["layers"]) == ["0", "1", "2"] and sorted(after["layers"]) == ["0", "2"]
    assert after["num_experts"] == 8 and after["layers"]["2"]["removed"] == [0, 7]
    assert after["layers"]["2"]["counts"][0] == after["layers"]["2"]["counts"][7] == 0
    assert after["layers"]["0"] == before["layers"]["0"]  # the first layer's routing does not change
    assert before["tokens"] == after["tokens"] == 120


def test_the_shipped_moe_recipe_passes_preflight():
    from sinv_prune.pipeline.preflight import preflight
    from sinv_prune.pipeline.recipe import builtin_recipes, load_recipe
    from sinv_prune.scoring.criteria import criterion_class

    path = builtin_recipes()["moe-quickstart"]
    if not (path.parent / "../../shared/data/wikitext-2/test.txt").is_file():
        pytest.skip("WikiText-2 is not in ../shared/data")
    arms = "[{criterion: random, unit: experts, amount: 0.25}, {criterion: random, unit: experts, amount: 0.5}]"
    preflight(load_recipe(path, [f"prune.arms={arms}"]))  # data files, model config, amounts, tracking
    recipe = load_recipe(path)
    names = sorted({p.criterion for arm in recipe.prune.arms for p in arm.part_specs})
    assert names == ["ean", "frequency", "magnitude", "random", "reap", "sinv_early", "sinv_static"]
    missing = []
    for name in names:
        try:
            if "experts" not in criterion_class(name).units:
                missing.append(name)
        except (KeyError, ValueError):
            missing.append(name)
    if missing:
        pytest.skip(f"criteria that do not score experts in this checkout: {missing}")
    preflight(recipe)
