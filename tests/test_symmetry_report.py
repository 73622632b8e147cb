"""``alignment_report``: files written atomically, one table of top_k rows per head, reload path."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, tiny_model

from sinv_prune.data import train_tokenizer
from sinv_prune.pipeline.report_alignment import alignment_report
from sinv_prune.symmetry import add_symmetry_breaking

PNG = b"\x89PNG\r\n\x1a\n"
WORDS = [f"w{i}" for i in range(VOCAB - 4)]  # and 4 special tokens


def word_tokenizer():
    """A word-level tokenizer with exactly VOCAB tokens (4 special + the words)."""
    tok = train_tokenizer([" ".join(WORDS)] * 2, "word")
    assert len(tok) == VOCAB
    return tok


def head_tables(markdown: str) -> dict[tuple[int, int], list[str]]:
    """Per ``## Layer l, head h`` section, its table body rows."""
    tables, current = {}, None
    for line in markdown.splitlines():
        m = re.match(r"## Layer (\d+), head (\d+)", line)
        if m:
            current = tables.setdefault((int(m[1]), int(m[2])), [])
        elif current is not None and re.match(r"\| \d+ \|", line):
            current.append(line)
    return tables


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_report_files_tables_and_summary(arch, tmp_path):
    model = tiny_model(arch)
    add_symmetry_breaking(model, seed=0)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    vocab = [f"tok{i}" for i in range(VOCAB)]
    top_k = 4
    out = alignment_report(model, tmp_path / "report", tokenizer=vocab, top_k=top_k)

    for kind, name in (("markdown", "alignment.md"), ("json", "alignment.json"), ("png", "alignment.png")):
        assert out[kind] == str(tmp_path / "report" / name)
    names = sorted(p.name for p in (tmp_path / "report").iterdir())
    assert names == ["alignment.json", "alignment.md", "alignment.png"]
    with open(out["png"], "rb") as f:
        assert f.read(8) == PNG
    import matplotlib.image

    assert matplotlib.image.imread(out["png"]).ndim == 3  # decodes as an image

    summary = out["summary"]
    n_layers = model.config.num_hidden_layers
    n_heads = model.config.num_attention_heads
    assert summary["b_q_source"] == "model" and summary["note"] is None
    assert summary["layers"] == list(range(n_layers)) and summary["num_heads"] == n_layers * n_heads
    assert summary["top_k"] == top_k and len(summary["heads"]) == n_layers * n_heads
    head_dim = model.config.n_embd // n_heads if arch == "gpt2" else model.config.head_dim
    assert summary["b_q_mean"]["0"] == [0.5] * head_dim
    first = summary["heads"][0]
    assert first["top_cosine"] >= first["bottom_cosine"] and first["top_token"].startswith("tok")

    tables = head_tables(Path(out["markdown"]).read_text())
    assert sorted(tables) == [(l, h) for l in range(n_layers) for h in range(n_heads)]  # noqa: E741
    assert all(len(rows) == top_k for rows in tables.values())
    assert "own symmetry-breaking" in Path(out["markdown"]).read_text()

    data = json.loads(Path(out["json"]).read_text())
    assert data["summary"] == json.loads(json.dumps(summary))
    assert len(data["rows"]) == n_layers * n_heads * 2 * top_k
    assert {(r["side"], r["rank"]) for r in data["rows"]} == {(s, k) for s in ("top", "bottom") for k in range(1, 5)}
    for k, v in model.state_dict().items():  # the model is untouched
        assert torch.equal(v, state[k])
    assert not [p for p in (tmp_path / "report").iterdir() if p.name.startswith(".")]  # no temp files left


def test_report_without_symmetry_breaking_uses_the_paper_default_and_says_so(tmp_path):
    model = tiny_model("gpt2")
    out = alignment_report(model, tmp_path, layer=1, top_k=2)
    summary = out["summary"]
    assert summary["b_q_source"] == "paper default"
    assert "no symmetry breaking" in summary["note"] and "0.5" in summary["note"]
    assert summary["layers"] == [1] and summary["b_q_mean"] == {"1": [0.5] * 8}
    text = Path(out["markdown"]).read_text()
    assert "no symmetry breaking" in text and "paper-default" in text
    assert all(len(rows) == 2 for rows in head_tables(text).values()) and len(head_tables(text)) == 4
    assert json.loads(Path(out["json"]).read_text())["rows"][0]["token"] == str(summary["heads"][0]["top_token"])

    # b_Q off, b_V on: the model has breaking but no query bias
    model2 = tiny_model("gpt2")
    add_symmetry_breaking(model2, b_q=None)
    assert "no query bias" in alignment_report(model2, tmp_path / "b", layer=0, top_k=1)["summary"]["note"]


def test_reload_path_restores_the_setting_and_tokenizer(tmp_path):
    model = tiny_model("gpt2")
    b_q = {"mean": [(-1) ** i * 0.1 * (i + 1) for i in range(8)], "std": 0.1}
    add_symmetry_breaking(model, b_q=b_q, seed=3)
    tok = word_tokenizer()
    in_memory = alignment_report(model, tmp_path / "mem", tokenizer=tok, top_k=3)

    ckpt = tmp_path / "ckpt"
    model.save_pretrained(ckpt)
    tok.save_pretrained(ckpt)
    reloaded = alignment_report(str(ckpt), tmp_path / "disk", top_k=3)  # tokenizer found in the directory
    assert reloaded["summary"]["b_q_source"] == "model"
    assert reloaded["summary"]["b_q_mean"] == in_memory["summary"]["b_q_mean"]
    rows_mem = json.loads(Path(in_memory["json"]).read_text())["rows"]
    rows_disk = json.loads(Path(reloaded["json"]).read_text())["rows"]
    assert [(r["token_id"], r["token"]) for r in rows_disk] == [(r["token_id"], r["token"]) for r in rows_mem]
    assert [r["cosine"] for r in rows_disk] == pytest.approx([r["cosine"] for r in rows_mem], abs=1e-6)
    assert {r["token"] for r in rows_disk} <= set(tok.get_vocab())

    # a checkpoint without a tokenizer: ids as labels; rewriting the same directory replaces the files
    bare = tmp_path / "bare"
    model.save_pretrained(bare)
    again = alignment_report(bare, tmp_path / "disk", layer=[0, 2], top_k=1)
    assert again["summary"]["layers"] == [0, 2]
    rows = json.loads(Path(again["json"]).read_text())["rows"]
    assert all(r["token"] == str(r["token_id"]) for r in rows) and {r["layer"] for r in rows} == {0, 2}


def test_markdown_cells_keep_odd_tokens_readable(tmp_path):
    vocab = [f"t{i}" for i in range(VOCAB)]
    vocab[1:5] = ["a|b", "<unk>", "x`y", "new\nline"]
    out = alignment_report(tiny_model("gpt2"), tmp_path, tokenizer=vocab, layer=0, top_k=VOCAB)
    text = Path(out["markdown"]).read_text()
    for cell in ("`a\\|b`", "`<unk>`", "``x`y``", "`new\\nline`"):
        assert cell in text
    tables = head_tables(text)
    assert all(len(rows) == VOCAB for rows in tables.values())
    assert all(row.count(" | ") == 4 for rows in tables.values() for row in rows)  # no cell split by a token


def test_bad_arguments(tmp_path):
    model = tiny_model("gpt2")
    with pytest.raises(ValueError, match="top_k"):
        alignment_report(model, tmp_path, top_k=0)
    with pytest.raises(ValueError, match="out of range"):
        alignment_report(model, tmp_path, layer=5)
    assert not list(tmp_path.iterdir())


def test_cli_align_writes_the_report_and_refuses_to_overwrite(tmp_path):
    from click.testing import CliRunner

    from sinv_prune.cli import main

    model = tiny_model("gpt2")
    model.save_pretrained(tmp_path / "m")
    result = CliRunner().invoke(main, ["align", str(tmp_path / "m"), "-o", str(tmp_path / "a"), "--top-k", "3"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "a" / "alignment.md").exists() and (tmp_path / "a" / "alignment.json").exists()
    again = CliRunner().invoke(main, ["align", str(tmp_path / "m"), "-o", str(tmp_path / "a")])
    assert again.exit_code == 2 and "--overwrite" in again.output
