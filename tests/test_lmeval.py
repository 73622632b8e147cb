"""lm-eval on in-memory models: the shipped last-word task, local task directories, remote-code and GGUF models."""

from __future__ import annotations

import json
import math
import random
from collections import Counter

import pytest
import torch
import transformers
import yaml
from transformers.modeling_outputs import CausalLMOutput

pytest.importorskip("lm_eval", reason='lm-eval is not installed (pip install "sinv_prune[eval]")')

import sinv_prune  # noqa: E402
from sinv_prune.data import train_tokenizer  # noqa: E402
from sinv_prune.lmeval import evaluate_tasks, resolve_tasks  # noqa: E402
from sinv_prune.lmeval.lastword import build_lastword_task, lastword_items  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

WORDS = ["red", "blue", "green", "cat", "dog", "bird", "runs", "sees", "eats", "big", "small", "the", "a", "of", "and"]


def mc_task(directory, words=WORDS, n: int = 30, seed: int = 0, name: str = "tiny_mc"):
    """A multiple-choice lm-eval task of ``n`` items over ``words``, as a directory (JSON lines + YAML)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{name}.jsonl"
    with data.open("w") as f:
        for _ in range(n):
            question = " ".join(rng.choice(words) for _ in range(6))
            item = {"question": question, "choices": rng.sample(words, 3), "label": rng.randrange(3)}
            f.write(json.dumps(item) + "\n")
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "{{question}}",
        "doc_to_target": "label",
        "doc_to_choice": "{{choices}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1.0},
    }
    (directory / f"{name}.yaml").write_text(yaml.safe_dump(config))
    return directory


def word_tokenizer(lines):
    return train_tokenizer(lines, kind="word")


# -- the WikiText last-word task -------------------------------------------------------------------


def fake_wikitext(path, paragraphs: int = 40, seed: int = 0):
    """A small text in WikiText-2's word-level layout: headings, blank lines, paragraphs ending in ' .'."""
    rng = random.Random(seed)
    lines = [" ", " = A heading = ", " "]
    for i in range(paragraphs):
        body = " ".join(rng.choice(WORDS) for _ in range(rng.randint(22, 40)))
        lines.append(f" {body} , {rng.choice(WORDS[:8])} . ")
        if i % 10 == 0:
            lines += [f" {body} in 1 @,@ 000 . ", f" {body} <unk> . ", " short line . "]  # not usable: skipped
    path.write_text("\n".join(lines) + "\n")
    return path


class LookupLM(transformers.GPT2LMHeadModel):
    """Logits from a rule, not weights: ``next_token(prefix)`` gets logit 10, every other token 0."""

    def set_rule(self, next_token):
        self.next_token = next_token
        return self

    def forward(self, input_ids=None, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.config.vocab_size)
        for b, row in enumerate(input_ids.tolist()):
            for t in range(len(row)):
                token = self.next_token(tuple(row[: t + 1]))
                if token is not None:
                    logits[b, t, token] = 10.0
        return CausalLMOutput(logits=logits)


def lookup_lm(vocab_size: int, rule) -> LookupLM:
    config = transformers.GPT2Config(vocab_size=vocab_size, n_layer=1, n_head=1, n_embd=4, n_positions=4096)
    return LookupLM(config).eval().set_rule(rule)


@pytest.fixture(scope="module")
def lastword(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lastword")
    task_dir = build_lastword_task(tmp / "cache", fake_wikitext(tmp / "test.txt"))
    items = [json.loads(line) for line in (task_dir / "wikitext_lastword.jsonl").read_text().splitlines()]
    tokenizer = word_tokenizer([it["context"] + " " + it["target"] for it in items])
    return task_dir, items, tokenizer


def test_lastword_items_take_the_last_word_of_usable_paragraphs():
    lines = [" = Title = ", "", " " + " ".join(["w"] * 25) + " , ends here . ", " too short here . ",
             " " + " ".join(["w"] * 25) + " in 1 @,@ 000 . ", " " + " ".join(["w"] * 25) + " 's <unk> . "]  # fmt: skip
    items = lastword_items(lines)
    assert items == [{"context": " ".join(["w"] * 25) + ", ends", "target": "here", "line": 3}]


def test_an_oracle_scores_1_and_a_constant_model_the_base_rate(lastword):
    task_dir, items, tokenizer = lastword
    tasks = resolve_tasks([str(task_dir)])
    assert tasks.names == ["wikitext_lastword"] and len(items) == 40
    table = {}
    for it in items:
        ids = tokenizer(it["context"] + " " + it["target"], add_special_tokens=False)["input_ids"]
        table.update({tuple(ids[: t + 1]): ids[t + 1] for t in range(len(ids) - 1)})
    vocab = len(tokenizer)
    oracle = evaluate_tasks(lookup_lm(vocab, table.get), tokenizer, tasks, batch_size=4)["tasks"]["wikitext_lastword"]
    assert oracle["acc"] == 1.0
    # one token per target, probability e^10 / (e^10 + vocab - 1): lambada's perplexity is 1 / that
    assert oracle["perplexity"] == pytest.approx(math.exp(math.log(math.exp(10) + vocab - 1) - 10), rel=1e-5)
    word, count = Counter(it["target"] for it in items).most_common(1)[0]
    constant_id = tokenizer.convert_tokens_to_ids(word)
    const = evaluate_tasks(lookup_lm(vocab, lambda prefix: constant_id), tokenizer, tasks, batch_size=4)
    assert const["tasks"]["wikitext_lastword"]["acc"] == pytest.approx(count / len(items))
    assert const["pins"]["tasks"]["wikitext_lastword"]["version"] == 1.0


def test_lastword_builds_once_and_outside_the_source(tmp_path):
    text = fake_wikitext(tmp_path / "test.txt")
    first = build_lastword_task(tmp_path / "cache", text)
    assert build_lastword_task(tmp_path / "cache", text) == first
    built = json.loads((first / "build.json").read_text())
    assert built["items"] == 40 and built["source"] == str(text.resolve())
    config = yaml.safe_load((first / "wikitext_lastword.yaml").read_text())
    assert config["dataset_kwargs"]["data_files"]["test"] == str((first / "wikitext_lastword.jsonl").resolve())


# -- local tasks on tiny, remote-code and GGUF models ---------------------------------------------


def test_an_uneven_remote_code_model_evaluates_as_it_did_in_memory(tmp_path):
    task_dir = mc_task(tmp_path / "tasks")
    tokenizer = word_tokenizer([" ".join(WORDS)])
    model = tiny_model("llama")
    sinv_prune.prune_heads(model, {0: [1, 4], 1: [0, 2, 3, 5]})
    model.save_pretrained(tmp_path / "pruned")
    reloaded = sinv_prune.from_pretrained(tmp_path / "pruned").eval()
    assert type(reloaded).__name__.startswith("SinvPruned")
    tasks = resolve_tasks([str(task_dir)])
    before = evaluate_tasks(model, tokenizer, tasks, batch_size=4)
    after = evaluate_tasks(reloaded, tokenizer, tasks, batch_size=4)
    assert after["tasks"]["tiny_mc"]["acc"] == before["tasks"]["tiny_mc"]["acc"]
    assert after["tasks"]["tiny_mc"]["samples"] == 30 and after["tasks"]["tiny_mc"]["acc_stderr"] > 0


def test_limit_and_pins(tmp_path):
    task_dir = mc_task(tmp_path / "tasks")
    tokenizer = word_tokenizer([" ".join(WORDS)])
    out = evaluate_tasks(tiny_model("gpt2"), tokenizer, resolve_tasks([str(task_dir)]), limit=7, batch_size="auto")
    pins = out["pins"]
    assert out["tasks"]["tiny_mc"]["samples"] == 7
    assert pins["limit"] == 7 and pins["num_fewshot"] == 0 and pins["batch_size"] == 8  # auto on the CPU
    assert pins["lm_eval_version"] and pins["tasks"]["tiny_mc"]["samples"] == {"original": 30, "effective": 7}


@pytest.mark.real
@pytest.mark.slow
def test_a_gguf_loaded_model_evaluates_through_the_cli(tmp_path):
    from click.testing import CliRunner

    from sinv_prune.cli import main
    from tests.conftest import smollm2_gguf

    gguf = smollm2_gguf()
    task_dir = mc_task(tmp_path / "tasks", n=8)
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(main, ["eval", str(gguf), "--tasks", str(task_dir), "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "tiny_mc" in result.output and "acc" in result.output
    saved = json.loads(out.read_text())
    assert saved["tasks"]["tiny_mc"]["samples"] == 8 and 0 <= saved["tasks"]["tiny_mc"]["acc"] <= 1


def test_a_group_is_one_column_with_its_aggregate(tmp_path):
    from sinv_prune.lmeval import TaskSet
    from sinv_prune.lmeval.report import task_lines

    task_dir = mc_task(tmp_path / "tasks", name="mc_a")
    mc_task(tmp_path / "tasks", name="mc_b", seed=1, n=10)
    group = {"group": "mc_group", "task": ["mc_a", "mc_b"], "metadata": {"version": 1.0},
             "aggregate_metric_list": [{"metric": "acc", "aggregation": "mean", "weight_by_size": True}]}  # fmt: skip
    (task_dir / "mc_group.yaml").write_text(yaml.safe_dump(group))
    tokenizer = word_tokenizer([" ".join(WORDS)])
    out = evaluate_tasks(tiny_model("gpt2"), tokenizer, TaskSet(["mc_group"], [str(task_dir)]), batch_size=4)
    assert set(out["tasks"]) == {"mc_group", "mc_a", "mc_b"} and out["pins"]["columns"] == ["mc_group"]
    a, b = out["tasks"]["mc_a"]["acc"], out["tasks"]["mc_b"]["acc"]
    assert out["tasks"]["mc_group"]["acc"] == pytest.approx((30 * a + 10 * b) / 40)
    evaluation = {"params": 1, "tasks": out["tasks"], "lm_eval": out["pins"]}
    lines = task_lines({"baseline": evaluation, "arms": []})
    assert lines[2] == "| arm | stage | params | mc_group (acc) | mean |"


def test_missing_wikitext_and_bad_entries_are_one_line_errors(tmp_path, monkeypatch):
    from sinv_prune.lmeval import TasksError

    monkeypatch.setenv("SINV_PRUNE_WIKITEXT", str(tmp_path / "none"))
    with pytest.raises(TasksError, match=r"^tasks\[0\]: wikitext_lastword: WikiText-2 test text not found at .*"
                                         r"set SINV_PRUNE_WIKITEXT"):  # fmt: skip
        resolve_tasks(["wikitext_lastword"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(TasksError, match=r"^tasks\[0\]: no lm-eval task \(a YAML file with a 'task:' key\) in "):
        resolve_tasks([str(tmp_path / "empty")])
    task_dir = mc_task(tmp_path / "mc")
    with pytest.raises(TasksError, match="is a file; give the directory"):
        resolve_tasks([str(task_dir / "tiny_mc.yaml")])
    with pytest.raises(TasksError, match="'tiny_mc' is asked for twice"):
        resolve_tasks([str(task_dir), str(task_dir)])


def test_relative_data_files_are_read_from_the_yaml_directory(tmp_path, monkeypatch):
    from sinv_prune.lmeval.harness import with_data_files_from

    task_dir = mc_task(tmp_path / "tasks")
    config = yaml.safe_load((task_dir / "tiny_mc.yaml").read_text())
    (task_dir / "data").mkdir()
    (task_dir / "tiny_mc.jsonl").rename(task_dir / "data" / "tiny_mc.jsonl")
    config["dataset_kwargs"]["data_files"] = {"test": "data/tiny_mc.jsonl"}
    (task_dir / "tiny_mc.yaml").write_text(yaml.safe_dump(config))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # no data/ here: read from the working directory, the file is missing
    out = evaluate_tasks(tiny_model("gpt2"), word_tokenizer([" ".join(WORDS)]), resolve_tasks(["../tasks"]),
                         batch_size=4)  # fmt: skip
    assert out["tasks"]["tiny_mc"]["samples"] == 30
    kept = {"dataset_kwargs": {"data_files": ["/abs/a.json", "hf://x/b.json", "c.json"]}}
    assert with_data_files_from(kept, tmp_path)["dataset_kwargs"]["data_files"] == [
        "/abs/a.json", "hf://x/b.json", str(tmp_path / "c.json")]  # fmt: skip
