"""Recipe arms with compensation and rounds, and HeadPruner's compensation passthrough."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import yaml
from conftest import model_inputs, model_output, tiny_model
from test_pipeline import TINY, invoke, recipe_file

import sinv_prune
from sinv_prune import HeadPruner

ARMS = [
    {"criterion": "magnitude", "amount": 2, "compensate": {"method": "lsq", "batches": 2, "batch_size": 2}},
    {"criterion": "activation", "amount": 4, "rounds": 2, "compensate": {"method": "bias", "batches": 2}},
    {"criterion": "random", "amount": 2, "seed": 3},
    {
        "unit": "mlp",
        "criterion": "activation",
        "amount": 0.25,
        "rounds": 2,
        "compensate": {"method": "lsq", "batches": 2},
    },
    {
        "parts": [{"criterion": "magnitude", "amount": 2}, {"criterion": "magnitude", "unit": "mlp", "amount": 32}],
        "rounds": 2,
    },
]
RECOVERY = {**TINY, "name": "recovery", "prune": {"arms": ARMS}, "finetune": None}


def calibration(n=3, length=9):
    return [model_inputs(seed=s, batch=2, length=length) for s in range(n)]


@pytest.fixture(scope="module")
def recovery_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recovery")
    result = invoke(recipe_file(tmp, {k: v for k, v in RECOVERY.items() if v is not None}), "--output", tmp / "out",
                    "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    return tmp / "out"


def test_arms_record_compensation_and_rounds(recovery_run):
    results = json.loads((recovery_run / "results.json").read_text())
    arms = {a["name"]: a for a in results["arms"]}
    assert set(arms) >= {"magnitude-2-global-lsq", "activation-4-global-bias-r2", "random-2-global"}

    lsq = arms["magnitude-2-global-lsq"]
    comp = lsq["compensation"]
    assert comp["method"] == "lsq" and comp["batches"] == 2 and comp["tokens"] == 2 * 2 * TINY["data"]["seq_len"]
    assert comp["layers"] and all(f["error_after"] <= f["error_before"] + 1e-9 for f in comp["layers"])

    rounds = arms["activation-4-global-bias-r2"]
    assert rounds["rounds"] == 2 and len(rounds["per_round"]) == 2
    assert all(r["compensation"]["method"] == "bias" for r in rounds["per_round"])
    per_round = [{(int(k), h) for k, hs in r["selection"]["heads"].items() for h in hs} for r in rounds["per_round"]]
    assert not per_round[0] & per_round[1]
    assert per_round[0] | per_round[1] == {(int(k), h) for k, hs in rounds["removed"].items() for h in hs}
    assert rounds["heads_removed"] == 4

    channels = arms["activation-mlp-0.25-global-lsq-r2"]  # MLP channels in two rounds, each compensated
    assert channels["rounds"] == 2 and [r["channels_removed"] for r in channels["per_round"]] == [32, 32]
    assert channels["channels_removed"] == 64 and all(r["compensation"]["method"] == "lsq"
                                                      for r in channels["per_round"])  # fmt: skip
    mixed = arms["magnitude-heads-2-global+magnitude-mlp-32-global-r2"]
    assert [(r["heads_removed"], r["channels_removed"]) for r in mixed["per_round"]] == [(1, 16), (1, 16)]
    assert (mixed["heads_removed"], mixed["channels_removed"]) == (2, 32)

    plain = arms["random-2-global"]
    assert plain["compensation"] is None and plain["rounds"] == 1
    report = (recovery_run / "report.md").read_text()
    assert "`magnitude-2-global-lsq`: compensated by `lsq`" in report
    assert f"held-out cross-entropy {comp['heldout_loss']['plain']:.4f} plain" in report
    assert comp["heldout_tokens"] == TINY["data"]["seq_len"] and f"kept the {comp['kept']} model" in report
    assert "`activation-4-global-bias-r2`: compensated by `bias` in every round; removed in 2 rounds" in report


def test_a_compensated_arm_reloads_with_its_evaluated_perplexity(recovery_run):
    """The saved arm is the compensated model: reloading it gives the perplexity the run recorded."""
    results = json.loads((recovery_run / "results.json").read_text())
    arm = next(a for a in results["arms"] if a["name"] == "magnitude-2-global-lsq")
    model = sinv_prune.from_pretrained(recovery_run / arm["model_dir"])
    base = sinv_prune.from_pretrained(recovery_run / "base")
    assert sinv_prune.count_parameters(model) == arm["params"] < sinv_prune.count_parameters(base)
    plain = copy.deepcopy(base)
    sinv_prune.prune_heads(plain, {int(k): v for k, v in arm["removed"].items()})
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, dict(plain.named_parameters())[n])]
    assert changed and all("c_proj" in n and ".attn." in n for n in changed)  # only the refitted projections


@pytest.mark.parametrize(
    ("arm", "message"),
    [
        ({"criterion": "sinv_early", "amount": 2, "rounds": 2}, "prune.arms[0].rounds: sinv_early scores from the"),
        ({"criterion": "magnitude", "amount": 2, "compensate": {"method": "bias"}}, "prune.arms[0].compensate: "
         "compensate='bias' needs an output-projection bias"),
        ({"criterion": "magnitude", "amount": 2, "compensate": {"method": "lsq", "batches": 0}},
         "prune.arms[0].compensate.batches"),
        ({"criterion": "magnitude", "amount": 2, "rounds": 0}, "prune.arms[0].rounds"),
        ({"criterion": "magnitude", "amount": 2, "compensate": {"method": "lsq", "target": "residual"}},
         "prune.arms[0].compensate: target='residual' needs pre-norm blocks (the LLaMA layout); gpt2 has none"),
    ],
)  # fmt: skip
def test_bad_recovery_arms_exit_2_before_any_work(tmp_path, arm, message):
    model = TINY["model"] if "bias" not in json.dumps(arm) else LLAMA
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**TINY, "model": model, "prune": {"arms": [arm]}}))
    result = invoke(path, "--output", tmp_path / "out", "--dry-run")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not (tmp_path / "out").exists()


LLAMA = {
    "architecture": "llama",
    "config": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
               "intermediate_size": 48, "head_dim": 8},
}  # fmt: skip


# -- HeadPruner --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_head_pruner_compensates_like_prune_heads(arch):
    model = tiny_model(arch)
    pruner = HeadPruner("magnitude", 2 if arch == "gpt2" else 3, compensate="lsq", compensation_options={"ridge": 0.5})
    reference = copy.deepcopy(model)
    summary = pruner.prune(model, calibration=calibration())
    heads = pruner.last_selection["heads"]
    sinv_prune.prune_heads(reference, heads, calibration=calibration(), compensate="lsq", ridge=0.5)
    assert summary.compensation is not None and summary.compensation.ridge == 0.5
    torch.testing.assert_close(model_output(model, model_inputs()), model_output(reference, model_inputs()))


def test_head_pruner_rounds_compensate_every_round_and_refuse_without_calibration():
    model = tiny_model("gpt2")
    before = {n: p.clone() for n, p in model.state_dict().items()}
    pruner = HeadPruner("magnitude", 4, rounds=2, compensate="lsq")
    with pytest.raises(ValueError, match="needs calibration batches"):
        pruner.prune(model)
    assert all(torch.equal(p, before[n]) for n, p in model.state_dict().items())
    pruner.prune(model, calibration=iter(calibration()))  # an iterator is read once, used every round
    assert [r["compensation"]["method"] for r in pruner.last_rounds] == ["lsq", "lsq"]
    assert pruner.report()["compensate"] == "lsq"
    with pytest.raises(ValueError, match="unknown compensation"):
        HeadPruner("magnitude", 2, compensate="magic")
