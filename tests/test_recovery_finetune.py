"""Recovery you can budget and watch: the fine-tune's token budget, streamed and packed data, the recovery
curve (a TrainerCallback) and the cached teacher's top-k distillation (sinv_prune/pipeline/{training,
data_stream,recovery,distill_cache}.py)."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner
from conftest import VOCAB, tiny_model
from test_distill import BASE, batch, finetune_spec, peaked_teacher
from test_training import word_tokenizer

from sinv_prune.cli import main
from sinv_prune.data import token_ids
from sinv_prune.pipeline import estimate
from sinv_prune.pipeline.data_stream import Blocks, load_blocks, pack_rows, stream_blocks
from sinv_prune.pipeline.distill import DistillTrainer, distillation_kl
from sinv_prune.pipeline.distill_cache import TeacherCache, build_cache, topk_kl
from sinv_prune.pipeline.recipe import RecipeError, validate_recipe
from sinv_prune.pipeline.recovery import RecoveryCurve
from sinv_prune.pipeline.training import run_trainer


def random_blocks(n=24, seq=16, seed=0) -> Blocks:
    return Blocks(torch.randint(3, VOCAB, (n, seq), generator=torch.Generator().manual_seed(seed)))


def train(tmp_path, model, blocks, spec, **kwargs):
    return run_trainer(model, word_tokenizer(), blocks, None, spec, tmp_path / "ckpt", mlm=False, seed=0,
                       device="cpu", quiet=True, **kwargs)  # fmt: skip


# -- the token budget --------------------------------------------------------------------------------


@pytest.mark.parametrize(("tokens", "accumulation", "steps"), [(1000, 1, 16), (1024, 1, 16), (1000, 2, 8)])
def test_a_token_budget_stops_at_the_ceiling_of_its_steps(tmp_path, tokens, accumulation, steps):
    # 4 blocks of 16 tokens a micro-batch: 64 tokens a step (x accumulation); 1000 / 64 = 15.6 -> 16 steps
    spec = finetune_spec(tokens=tokens, gradient_accumulation_steps=accumulation, distill=None)
    out = train(tmp_path, tiny_model("gpt2").train(), random_blocks(), spec)
    assert out.global_step == steps == math.ceil(tokens / (64 * accumulation))
    assert estimate._steps(spec, 16, None) == steps  # --dry-run plans the same steps


def test_budget_keys_are_one_line_errors():
    with pytest.raises(RecipeError, match=r"^finetune: give tokens or max_steps, not both"):
        validate_recipe({**BASE, "finetune": {"tokens": 1000, "max_steps": 3}})
    with pytest.raises(RecipeError, match=r"^finetune: data: a streamed or generated source has no length; give tok"):
        validate_recipe({**BASE, "finetune": {"data": {"files": "a.txt"}}})
    with pytest.raises(RecipeError, match=r"^finetune\.data: give exactly one source of files, hub"):
        validate_recipe({**BASE, "finetune": {"tokens": 10, "data": {"files": "a.txt", "hub": {"path": "x/y"}}}})
    with pytest.raises(RecipeError, match=r"^finetune\.tokens: .*greater than 0"):
        validate_recipe({**BASE, "finetune": {"tokens": 0}})
    with pytest.raises(RecipeError, match=r"^train\.tokens: unknown key"):
        validate_recipe({**BASE, "train": {"tokens": 10}})


# -- streamed, packed data ---------------------------------------------------------------------------


def write_corpus(directory, lines_per_file=(40, 30)):
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    all_lines = []
    for i, count in enumerate(lines_per_file):
        lines = [" ".join(f"w{t}" for t in torch.randint(3, VOCAB, (int(n),), generator=g).tolist())
                 for n in torch.randint(1, 12, (count,), generator=g)]  # fmt: skip
        lines[3] = ""  # a blank line contributes nothing
        (directory / f"part{i}.txt").write_text("\n".join(lines) + "\n")
        all_lines += lines
    return all_lines


def test_streamed_files_pack_in_order_and_the_hub_path_reads_the_same(tmp_path):
    lines = write_corpus(tmp_path / "corpus")
    tokenizer = word_tokenizer()
    expected = token_ids(lines, tokenizer)  # word tokenizer: each non-blank line + EOS
    spec = validate_recipe({**BASE, "finetune": {"tokens": 100, "data": {"files": str(tmp_path / "corpus")}}})
    path = stream_blocks(spec.finetune.data, tokenizer, 16, 5, tmp_path / "blocks")
    blocks = load_blocks(path)
    assert len(blocks) == 5 and isinstance(blocks.blocks, np.memmap)
    assert torch.equal(torch.from_numpy(np.array(blocks.blocks)).reshape(-1).long(), expected[:80])
    assert blocks[2]["index"] == 2 and blocks[2]["input_ids"].tolist() == expected[32:48].tolist()
    assert stream_blocks(spec.finetune.data, tokenizer, 16, 5, tmp_path / "blocks") == path  # packed once
    short = load_blocks(stream_blocks(spec.finetune.data, tokenizer, 16, 10_000, tmp_path / "short"))
    assert len(short) == expected.numel() // 16  # a stream shorter than the budget gives what it has
    # the Hub branch (datasets.load_dataset(path, name, split=..., streaming=True)) on a local directory
    hub = validate_recipe({**BASE, "finetune": {"tokens": 100, "data": {"hub": {"path": str(tmp_path / "corpus")}}}})
    via_hub = load_blocks(stream_blocks(hub.finetune.data, tokenizer, 16, 5, tmp_path / "hub"))
    assert np.array_equal(np.asarray(via_hub.blocks), np.asarray(blocks.blocks))
    # ... and a text column of another name (JSON lines)
    (tmp_path / "jsonl").mkdir()
    (tmp_path / "jsonl" / "train.jsonl").write_text("".join(json.dumps({"id": i, "body": t}) + "\n"
                                                            for i, t in enumerate(lines)))  # fmt: skip
    column = {"hub": {"path": str(tmp_path / "jsonl"), "split": "train", "text_column": "body"}}
    spec = validate_recipe({**BASE, "finetune": {"tokens": 100, "data": column}}).finetune.data
    via_json = load_blocks(stream_blocks(spec, tokenizer, 16, 5, tmp_path / "json"))
    assert np.array_equal(np.asarray(via_json.blocks), np.asarray(blocks.blocks))


def test_a_streamed_local_dataset_trains_for_its_budget(tmp_path):
    write_corpus(tmp_path / "corpus", (200, 200))
    spec = finetune_spec(tokens=600, data={"files": str(tmp_path / "corpus")}, distill=None)
    steps = math.ceil(600 / 64)
    path = stream_blocks(spec.data, word_tokenizer(), 16, steps * 4, tmp_path / "blocks")
    blocks = load_blocks(path)
    assert len(blocks) == steps * 4  # only what the budget reads
    out = train(tmp_path, tiny_model("llama").train(), blocks, spec)
    assert out.global_step == steps and math.isfinite(out.training_loss)


def test_packing_drops_the_remainder_and_needs_a_separator():
    tokenizer = word_tokenizer()
    out = list(pack_rows(["w3 w4 w5", "", "w6 w7"], tokenizer, 3))
    assert out == [[3, 4, 5], [2, 6, 7]]  # w2 is EOS; the blank row adds nothing, the last EOS is left over
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        list(pack_rows(["w3"], tokenizer, 3))


# -- the recovery curve ------------------------------------------------------------------------------


def test_recovery_curve_points_at_zero_each_multiple_and_the_end(tmp_path):
    seen = []

    def evaluate(model):
        seen.append(model.training)
        return {"perplexity": float(len(seen)), "task_a": 0.5}

    curve = RecoveryCurve(evaluate, every_tokens=150, seq_len=16, path=tmp_path / "recovery.json")
    spec = finetune_spec(max_steps=10, distill=None)  # 64 tokens a step: 150 is crossed at steps 3, 5, 8
    model = tiny_model("gpt2").train()
    train(tmp_path, model, random_blocks(), spec, callbacks=[curve])
    assert [p["step"] for p in curve.points] == [0, 3, 5, 8, 10]
    assert [p["tokens"] for p in curve.points] == [0, 192, 320, 512, 640]
    assert seen == [False] * 5 and model.training  # evaluated in eval mode, handed back in training mode
    assert json.loads((tmp_path / "recovery.json").read_text()) == curve.points
    assert curve.points[0] == {"tokens": 0, "step": 0, "perplexity": 1.0, "task_a": 0.5}


# -- the teacher cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [True, False])
def test_topk_kl_over_the_whole_vocabulary_is_the_live_kl(causal):
    g = torch.Generator().manual_seed(0)
    student, teacher = torch.randn(3, 10, VOCAB, generator=g) * 3, torch.randn(3, 10, VOCAB, generator=g) * 3
    labels = torch.randint(0, VOCAB, (3, 10), generator=g)
    labels[0, 4:] = -100
    live = distillation_kl(student, teacher, labels, temperature=2.0, causal=causal)
    values, ids = torch.log_softmax(teacher / 2.0, dim=-1).topk(VOCAB, dim=-1)
    cached = topk_kl(student, values, ids, labels, temperature=2.0, causal=causal)
    assert cached.item() == pytest.approx(live.item(), rel=1e-5)
    # a smaller support is another, still non-negative, number
    small = topk_kl(student, values[..., :8], ids[..., :8], labels, temperature=2.0, causal=causal)
    assert small.item() >= 0 and abs(small.item() - live.item()) > 1e-3


def test_training_from_a_full_vocabulary_cache_is_training_from_the_live_teacher(tmp_path):
    teacher, student = peaked_teacher(), tiny_model("llama", seed=1).train()
    blocks = random_blocks(8)
    cache = build_cache(teacher, blocks.blocks, tmp_path / "cache", k=VOCAB, temperature=2.0, dtype="float32")
    spec = finetune_spec(max_steps=2, distill={"alpha": 0.5})
    inputs = {**batch(seed=2, rows=4, length=16), "index": torch.tensor([5, 1, 7, 2])}
    inputs["input_ids"] = inputs["labels"] = blocks.blocks[inputs["index"]]
    args = {"temperature": 2.0, "alpha": 0.5, "causal": True}
    live = DistillTrainer(model=student, args=_args(tmp_path), teacher=teacher, **args)
    cached = DistillTrainer(model=student, args=_args(tmp_path), cache=cache, **args)
    assert cached.compute_loss(student, inputs).item() == pytest.approx(live.compute_loss(student, inputs).item(),
                                                                        rel=1e-5)  # fmt: skip
    # and through run_trainer: the same two steps, the same weights
    twin = copy.deepcopy(student)
    spec = finetune_spec(max_steps=2, distill={"alpha": 0.5, "cache_top_k": VOCAB})
    train(tmp_path / "a", student, blocks, spec, teacher_cache=cache)
    with pytest.raises(ValueError, match="cache"):  # a batch without its index cannot look its rows up
        cached.compute_loss(student, {k: v for k, v in inputs.items() if k != "index"})
    assert not any(torch.equal(a, b) for a, b in zip(student.parameters(), twin.parameters(), strict=True))


class RecordingCache(TeacherCache):
    """A built cache that notes the blocks each batch looks up, in the order the batches come."""

    def __init__(self, path):
        super().__init__(path)
        self.drawn: list[int] = []

    def rows(self, index, device):
        self.drawn += index.tolist()
        return super().rows(index, device)


@pytest.mark.parametrize("shuffle", [True, False])
def test_cached_blocks_come_in_a_new_order_each_epoch_and_only_those_cached(tmp_path, shuffle):
    teacher, blocks = peaked_teacher(), random_blocks(12)
    # the cache holds the first 8 of 12 blocks (a budget below the text); 4 steps of 4 = two passes over them
    cache = RecordingCache(build_cache(teacher, blocks.blocks[:8], tmp_path / "cache", k=8, temperature=1.0).path)
    spec = finetune_spec(max_steps=4, shuffle=shuffle, distill={"cache_top_k": 8})
    train(tmp_path, tiny_model("llama", seed=1).train(), blocks, spec, teacher_cache=cache)
    first, second = cache.drawn[:8], cache.drawn[8:]
    assert len(cache.drawn) == 16 and sorted(first) == sorted(second) == list(range(8))
    if shuffle:
        assert first != list(range(8)) and second != first
    else:
        assert first == second == list(range(8))


def test_a_resumed_shuffled_finetune_draws_the_blocks_the_whole_one_draws(tmp_path, caplog):
    from transformers import TrainerCallback

    class StopAfter(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:  # before step 4's checkpoint: checkpoint-3 is the last
                raise KeyboardInterrupt

    teacher, blocks = peaked_teacher(), random_blocks(8)
    built = build_cache(teacher, blocks.blocks, tmp_path / "cache", k=8, temperature=1.0).path
    spec = finetune_spec(max_steps=6, save_every=1, distill={"cache_top_k": 8})
    whole, parts = RecordingCache(built), RecordingCache(built)
    train(tmp_path / "whole", tiny_model("llama", seed=1).train(), blocks, spec, teacher_cache=whole)
    model = tiny_model("llama", seed=1).train()
    with pytest.raises(KeyboardInterrupt):
        train(tmp_path / "parts", model, blocks, spec, teacher_cache=parts, callbacks=[StopAfter()])
    resumed = RecordingCache(built)
    caplog.set_level("INFO", logger="sinv_prune")
    train(tmp_path / "parts", model, blocks, spec, teacher_cache=resumed, resume=True)
    # checkpoint-3 holds three steps, 12 blocks: half-way through the second pass over the 8 blocks; the
    # resumed run draws the rest of that pass and the third as the whole run did
    assert "resuming training from" in caplog.text and "checkpoint-3" in caplog.text
    assert len(whole.drawn) == 24 and parts.drawn == whole.drawn[:16] and resumed.drawn == whole.drawn[12:]


def test_a_shuffled_cache_trains_as_the_live_teacher_does(tmp_path):
    # the same seed draws the same blocks for both; each batch's cached rows must be its own blocks' rows
    teacher, blocks = peaked_teacher(), random_blocks(8)
    cache = build_cache(teacher, blocks.blocks, tmp_path / "cache", k=VOCAB, temperature=2.0, dtype="float32")
    live_student = tiny_model("llama", seed=1).train()
    cached_student = copy.deepcopy(live_student)
    settings = {"temperature": 2.0, "alpha": 0.5}
    train(tmp_path / "live", live_student, blocks, finetune_spec(max_steps=4, distill=settings), teacher=teacher)
    spec = finetune_spec(max_steps=4, distill={**settings, "cache_top_k": VOCAB})
    train(tmp_path / "cached", cached_student, blocks, spec, teacher_cache=cache)
    for live, cached in zip(live_student.parameters(), cached_student.parameters(), strict=True):
        torch.testing.assert_close(cached, live, atol=2e-5, rtol=1e-4)
    start = tiny_model("llama", seed=1)
    assert not all(torch.equal(a, b) for a, b in zip(live_student.parameters(), start.parameters(), strict=True))


def _args(tmp_path):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "t"), use_cpu=True, report_to=[])


def test_the_cache_is_keyed_by_teacher_data_k_and_temperature(tmp_path):
    teacher, blocks = tiny_model("llama"), random_blocks(4).blocks
    first = build_cache(teacher, blocks, tmp_path, k=8, temperature=2.0)
    assert build_cache(teacher, blocks, tmp_path, k=8, temperature=2.0).path == first.path  # reused
    saved = []  # the same teacher read from two run directories (each run's base/) keys alike
    for where in ("run_a", "run_b"):
        copy.deepcopy(teacher).save_pretrained(tmp_path / where)
        saved.append(type(teacher).from_pretrained(tmp_path / where))
    assert saved[0].config._name_or_path != saved[1].config._name_or_path
    assert len({build_cache(model, blocks, tmp_path, k=8, temperature=2.0).path for model in saved}) == 1
    other_teacher = copy.deepcopy(teacher)
    with torch.no_grad():
        other_teacher.model.layers[1].mlp.down_proj.weight[3, 5] += 0.01
    changed = [
        build_cache(other_teacher, blocks, tmp_path, k=8, temperature=2.0),
        build_cache(teacher, blocks.flip(0), tmp_path, k=8, temperature=2.0),
        build_cache(teacher, blocks[:, :8], tmp_path, k=8, temperature=2.0),  # another sequence length
        build_cache(teacher, blocks, tmp_path, k=4, temperature=2.0),
        build_cache(teacher, blocks, tmp_path, k=8, temperature=1.0),
    ]
    assert len({c.path for c in changed} | {first.path}) == 6
    assert first.values.dtype == np.float16 and first.ids.dtype == np.int32 and first.values.shape == (4, 16, 8)
    values, ids = first.rows(torch.tensor([2, 0]), "cpu")
    with torch.no_grad():
        logits = teacher(input_ids=blocks[[2, 0]]).logits
    top, where = torch.log_softmax(logits / 2.0, dim=-1).topk(8, dim=-1)
    assert torch.equal(ids.long(), where) and torch.allclose(values.float(), top, atol=2e-3)
    with torch.no_grad():  # the top-k share of the probability, recomputed over every block
        every = torch.softmax(teacher(input_ids=blocks).logits / 2.0, dim=-1)
    assert first.coverage == pytest.approx(every.topk(8, dim=-1).values.sum(-1).mean().item(), rel=1e-5)
    with pytest.raises(IndexError, match="not in the teacher cache"):
        first.rows(torch.tensor([4]), "cpu")
    assert isinstance(TeacherCache(first.path), TeacherCache)


# -- a recipe, end to end ----------------------------------------------------------------------------


def tiny_recipe(tmp_path) -> dict:
    write_corpus(tmp_path / "corpus", (150, 150))
    return {
        "name": "tiny-recovery",
        "model": {"architecture": "gpt2", "config": {"n_layer": 2, "n_head": 4, "n_embd": 32, "n_positions": 64}},
        "data": {
            "synthetic": {"num_train": 60, "num_valid": 20, "num_test": 20},
            "tokenizer": {"kind": "word"},
            "seq_len": 32,
        },  # fmt: skip
        "train": {"max_steps": 2, "batch_size": 8, "learning_rate": 0.003},
        "score": {"batches": 1, "batch_size": 4},
        "prune": {"arms": [{"criterion": "magnitude", "amount": 2}, {"criterion": "random", "amount": 2}]},
        "finetune": {
            "tokens": 1000,
            "batch_size": 4,
            "eval_every_tokens": 400,
            "learning_rate": 0.003,
            "data": {"files": str(tmp_path / "corpus")},
            "distill": {"cache_top_k": 16, "alpha": 0.5},
        },  # fmt: skip
        "evaluate": {"speed": False, "prompts": []},
    }


def test_a_recipe_budgets_streams_caches_and_draws_its_recovery_curve(tmp_path, monkeypatch):
    """Interrupted in the second arm's fine-tune, resumed: one packed stream, one cache, whole curves."""
    from sinv_prune.pipeline import distill_cache
    from sinv_prune.pipeline import stages as pipeline

    recipe = tiny_recipe(tmp_path)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    dry = CliRunner().invoke(main, ["run", str(path), "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert "distill cache" in dry.output and "8 steps of 4x32" in dry.output  # ceil(1000 / 128)
    assert "4 recovery-curve points" in dry.output  # as many as the run takes (below)
    calls, builds = [], []
    real_trainer, real_build = pipeline.run_trainer, distill_cache.build_cache

    def interrupt_second(*args, **kwargs):
        if kwargs.get("teacher_cache") is not None:
            calls.append(kwargs["teacher_cache"])
            if len(calls) == 2:
                raise KeyboardInterrupt
        return real_trainer(*args, **kwargs)

    monkeypatch.setattr(pipeline, "run_trainer", interrupt_second)
    monkeypatch.setattr(distill_cache, "build_cache", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_recipe(validate_recipe(recipe), tmp_path / "out", quiet=True)
    assert len(calls) == 2 and calls[0] is calls[1]  # one cache for both arms
    built = (calls[0].path / "meta.json").stat().st_mtime_ns
    result = CliRunner().invoke(main, ["run", str(path), "--output", str(tmp_path / "out"), "--quiet", "--resume"])
    assert result.exit_code == 0, result.output
    assert len(builds) == 2 and (calls[0].path / "meta.json").stat().st_mtime_ns == built  # found by its key
    out = tmp_path / "out"
    results = json.loads((out / "results.json").read_text(), parse_constant=lambda c: pytest.fail(c))
    assert len(list((out / "distill_cache").iterdir())) == 1  # one cache for both arms
    assert len(list((out / "finetune_data").iterdir())) == 1
    for arm in results["arms"]:
        points = arm["recovery_curve"]
        assert [p["step"] for p in points] == [0, 4, 7, 8] and [p["tokens"] for p in points] == [0, 512, 896, 1024]
        assert arm["finetune_tokens"] == 1024
        # the 0-token point is the pruned model, the last the fine-tuned one (same text as the evaluate stage)
        assert points[0]["perplexity"] == pytest.approx(arm["pruned"]["perplexity"], rel=1e-4)
        assert points[-1]["perplexity"] == pytest.approx(arm["finetuned"]["perplexity"], rel=1e-4)
        assert arm["distill"]["cache_top_k"] == 16
    assert "plots/recovery_curve.png" in results["plots"] and (out / "plots" / "recovery_curve.png").is_file()
    report = (out / "report.md").read_text()
    assert "![recovery_curve](plots/recovery_curve.png)" in report and "Recovery curve" in report
    assert "the KL over the teacher's cached top-16 tokens): `magnitude-2-global`, `random-2-global`." in report


def test_a_masked_lm_cannot_cache_its_teacher_and_missing_files_are_named(tmp_path):
    bert = {"model": {"architecture": "bert", "config": {"num_hidden_layers": 2}},
            "data": {"synthetic": {}, "tokenizer": {"kind": "word"}}, "train": {"max_steps": 1},
            "prune": {"arms": [{"criterion": "magnitude", "amount": 1}]}}  # fmt: skip
    tiny_model("llama").save_pretrained(tmp_path / "llama")
    llama = {**BASE, "model": {"path": str(tmp_path / "llama")}, "train": None}
    for recipe, message in [
        ({**bert, "finetune": {"max_steps": 1, "distill": {"cache_top_k": 8}}}, "cache_top_k: a masked LM"),
        ({**llama, "finetune": {"max_steps": 1, "distill": {"cache_top_k": 65}}}, r"vocabulary \(64 tokens\)"),
        ({**BASE, "finetune": {"tokens": 9, "data": {"files": ["nowhere.txt"]}}}, r"files\[0\]: .*nowhere.txt does"),
    ]:
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(recipe))
        result = CliRunner().invoke(main, ["run", str(path), "--dry-run"])
        assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
        assert __import__("re").search(message, result.output), result.output


def test_a_resumed_curve_keeps_the_points_up_to_its_checkpoint(tmp_path):
    from types import SimpleNamespace

    path = tmp_path / "recovery.json"
    path.write_text(json.dumps([{"tokens": 64 * s, "step": s, "perplexity": 9.0} for s in (0, 3, 5, 8)]))
    curve = RecoveryCurve(lambda model: {"perplexity": 1.0}, every_tokens=150, seq_len=16, path=path)
    args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=1, world_size=1)
    state = SimpleNamespace(global_step=0, is_world_process_zero=True)
    model = tiny_model("gpt2").train()
    curve.on_train_begin(args, state, None, model=model)  # the Trainer loads the checkpoint's step after this
    for step in (6, 7, 8):  # resumed from checkpoint-5: the point at step 8 was taken after it, and goes
        state.global_step = step
        curve.on_step_end(args, state, None, model=model)
    curve.on_train_end(args, state, None, model=model)
    assert [(p["step"], p["perplexity"]) for p in curve.points] == [(0, 9.0), (3, 9.0), (5, 9.0), (8, 1.0)]
    assert json.loads(path.read_text()) == curve.points


def test_curve_points_carry_each_tasks_headline_metric(monkeypatch):
    from types import SimpleNamespace

    import sinv_prune.lmeval as lmeval
    from sinv_prune.pipeline import tasks as tasks_mod
    from sinv_prune.pipeline.recovery import curve_evaluator

    finetune = {"max_steps": 1, "eval_every_tokens": 10, "eval_max_tokens": 40}
    data = {**BASE["data"], "seq_len": 16}
    evaluate = {"tasks": ["a", "b"], "limit": 3}
    recipe = validate_recipe({**BASE, "data": data, "evaluate": evaluate, "finetune": finetune})
    ids = torch.randint(3, VOCAB, (200,), generator=torch.Generator().manual_seed(0))
    run = SimpleNamespace(recipe=recipe, ids={"test": ids}, tokenizer=word_tokenizer(), root="/nowhere")
    monkeypatch.setattr(tasks_mod, "_task_set", lambda *a: ("tasks", "manager"))
    calls = []
    fake = {"a": {"acc": 0.25, "acc_norm": 0.5}, "b": {"acc": 0.75}}
    monkeypatch.setattr(lmeval, "evaluate_tasks", lambda *a, **k: calls.append(k) or {"tasks": fake})
    point = curve_evaluator(run, masked_lm=False)(tiny_model("gpt2"))
    assert point["a"] == 0.5 and point["b"] == 0.75  # acc_norm where reported, else acc
    assert calls[0]["limit"] == 3 and math.isfinite(point["perplexity"])
    from sinv_prune.pipeline.evaluation import perplexity

    assert point["perplexity"] == pytest.approx(perplexity(tiny_model("gpt2"), ids, seq_len=16, max_tokens=40,
                                                           progress=False)["perplexity"])  # fmt: skip


def test_a_cache_that_holds_little_of_the_teacher_says_so(tmp_path, caplog):
    """A top-k that leaves most of the softened distribution in the rest outcome is named, with what to change."""
    teacher, blocks = tiny_model("llama"), random_blocks(4).blocks
    with caplog.at_level("WARNING", logger="sinv_prune"):
        low = build_cache(teacher, blocks, tmp_path, k=2, temperature=4.0)
    assert low.coverage < 0.5
    assert f"top 2 tokens hold only {100 * low.coverage:.0f}%" in caplog.text and "live teacher" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sinv_prune"):
        again = build_cache(teacher, blocks, tmp_path, k=2, temperature=4.0)  # reused: still said
    assert again.path == low.path and "top 2 tokens hold only" in caplog.text
    meta = json.loads((low.path / "meta.json").read_text())
    del meta["coverage"]  # a cache from before coverage was recorded
    (low.path / "meta.json").write_text(json.dumps(meta))
    caplog.clear()
    with caplog.at_level("INFO", logger="sinv_prune"):
        old = build_cache(teacher, blocks, tmp_path, k=2, temperature=4.0)
    assert math.isnan(old.coverage) and "before coverage was recorded" in caplog.text and "hold only" not in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="sinv_prune"):
        whole = build_cache(teacher, blocks, tmp_path, k=VOCAB, temperature=4.0, dtype="float32")
    assert whole.coverage == pytest.approx(1.0, abs=1e-4) and "hold only" not in caplog.text
