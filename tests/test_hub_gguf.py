"""GGUF files on the Hub: ``push`` uploads the file a run's ``export.gguf`` (or ``shrink --gguf``) wrote of the
pushed model, and the card says how to run it in llama.cpp. Against the stand-in Hub of ``test_hub.py``."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import gguf
import pytest
import torch
from click.testing import CliRunner
from conftest import tiny_model
from hub_server import StandInHub
from test_hub import TOKEN, card_parts, point_at

import sinv_prune
from sinv_prune.cli import main
from sinv_prune.deploy.gguf_header import header_fields
from sinv_prune.hub import push as hub_mod
from sinv_prune.hub.gguf_files import GGUFFile, file_type_name
from sinv_prune.hub.model_card import model_card
from sinv_prune.hub.push import push_pruned
from sinv_prune.surgery.removal import count_parameters

ARM = "magnitude-2-uniform"
UNIFORM = {layer: [0, 3] for layer in range(3)}  # one query head per KV group in every layer: llama.cpp's llama


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    server = StandInHub(TOKEN).start()
    with pytest.MonkeyPatch.context() as mp:
        point_at(mp, server.url, tmp_path_factory.mktemp("hf_home"))
        yield server
    server.stop()


@pytest.fixture(autouse=True)
def _fresh_hub_and_reload_here(hub, monkeypatch):
    """A clean stand-in Hub per test; the reload check's fresh process runs here (``test_hub.py`` tests it)."""
    hub.reset()
    monkeypatch.setattr(hub_mod, "_fresh_outputs", lambda model_dir, route, cls, ids, **_: hub_mod._reference(
        model_dir, None, ids)[0])  # fmt: skip
    yield
    assert not hub.errors and not hub.unknown, (hub.errors, hub.unknown)


def export(model, path: Path, type_: str):
    return sinv_prune.export_gguf(model, None, path, type=type_, verify=False, vocab=False)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run as the pipeline leaves it with ``export: {gguf: {type: q8_0}}``: each model's file beside it."""
    root = tmp_path_factory.mktemp("run")
    arm = root / "arms" / ARM
    base = tiny_model("llama")
    base.save_pretrained(root / "base")
    model = tiny_model("llama")
    sinv_prune.prune_heads(model, UNIFORM)
    model.save_pretrained(arm / "pruned")
    with torch.no_grad():  # stands in for fine-tuning
        for p in model.parameters():
            p.add_(0.01)
    model.save_pretrained(arm / "finetuned")
    files = {"baseline": export(base, root / "base" / "model.gguf", "q8_0"),
             ARM: export(model, arm / "model.gguf", "q8_0")}  # fmt: skip
    params = count_parameters(model)
    ev = {"params": params, "perplexity": 20.0, "eval": {"tokens": 100, "seq_len": 32, "stride": 16}}
    results = {
        "baseline": {"params": count_parameters(base), "perplexity": 19.0, "model_dir": "base"},
        "arms": [{"name": ARM, "criterion": "magnitude", "amount": 2, "mode": "uniform", "pruned": ev,
                  "finetuned": ev, "model_dir": f"arms/{ARM}/finetuned", "params": params}],
        "gguf": {name: {**out.to_json(), "path": str(out.path.relative_to(root))} for name, out in files.items()},
        "run": {"name": "gguf-push", "device": "cpu", "eval_split": "test", "task": "causal-lm"},
    }  # fmt: skip
    (root / "results.json").write_text(json.dumps(results))
    return SimpleNamespace(root=root, arm=arm, model=model, files=files)


def push(*args):
    result = CliRunner().invoke(main, ["push", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result


def test_push_of_an_arm_uploads_the_gguf_its_run_exported_and_the_card_says_how_to_run_it(hub, run_dir):
    result = push(run_dir.root / ARM, "--repo-id", "tester/arm")
    received = hub.received["tester/arm"]
    exported = run_dir.arm / "model.gguf"
    assert received["model.gguf"] == exported.read_bytes()  # beside the model in the run, at the repo's top
    on_disk = {p.name for p in (run_dir.arm / "finetuned").iterdir()}
    assert set(received) == on_disk | {"model.gguf", "README.md"}
    assert f"pushed {len(received)} files" in result.output

    _, body = card_parts(received["README.md"].decode())
    section = body.split("## Use with llama.cpp", 1)[1].split("\n## ", 1)[0]
    size = exported.stat().st_size / 2**10
    assert f"- `model.gguf`: type `q8_0`, {size:,.1f} KiB, llama.cpp architecture `llama`; no vocabulary" in section
    assert "hf download tester/arm model.gguf --local-dir ." in section
    assert "this checkpoint's file is in this repository" in body  # the evaluation table's GGUF note

    push(run_dir.arm / "pruned", "--repo-id", "tester/pruned")  # the arm's other model: the file is not its own
    received = hub.received["tester/pruned"]
    assert not any(name.endswith(".gguf") for name in received)
    _, body = card_parts(received["README.md"].decode())
    assert "## Use with llama.cpp" not in body and "not part of this repository" in body


def test_a_gguf_inside_the_checkpoint_as_shrink_writes_it_is_named_with_its_type(hub, run_dir, tmp_path):
    """``sinv-prune shrink OUT --gguf TYPE`` writes ``OUT/model.gguf``: pushed with OUT, its type on the card."""
    out = tmp_path / "shrunk"
    run_dir.model.save_pretrained(out)
    export(run_dir.model, out / "model.gguf", "f16")
    result = push_pruned(out, "tester/shrunk")
    assert "model.gguf" in result.files
    received = hub.received["tester/shrunk"]
    assert received["model.gguf"] == (out / "model.gguf").read_bytes()
    _, body = card_parts(received["README.md"].decode())
    assert "- `model.gguf`: type `f16`," in body and "llama.cpp architecture `llama`" in body


def test_a_file_with_a_vocabulary_gets_the_llama_cpp_commands():
    config = tiny_model("llama").config
    file = GGUFFile(Path("x.gguf"), "smol-q4_k_m.gguf", "q4_k_m", "deci", 3 * 2**20, vocab=True)
    _, body = card_parts(model_card(config, repo_id="me/smol", gguf=[file]))
    assert "- `smol-q4_k_m.gguf`: type `q4_k_m`, 3.0 MiB, llama.cpp architecture `deci`\n" in body
    for command in ("hf download me/smol smol-q4_k_m.gguf --local-dir .", "llama-cli -m smol-q4_k_m.gguf",
                    "llama-server -m smol-q4_k_m.gguf"):  # fmt: skip
        assert command in body


def test_the_header_fields_are_what_gguf_reader_reads(run_dir):
    """The fast header scan against the gguf package's full reader, on every scalar field of both files."""
    for out in run_dir.files.values():
        reader = gguf.GGUFReader(out.path)
        expected = {}
        for key, field in reader.fields.items():
            kind = field.types[0]
            if kind == gguf.GGUFValueType.ARRAY or key.startswith("GGUF."):
                continue
            value = field.parts[field.data[0]]
            expected[key] = bytes(value).decode() if kind == gguf.GGUFValueType.STRING else value[0].item()
        assert len(expected) > 5
        assert header_fields(out.path, set(expected) | {"absent.key"}) == pytest.approx(expected)
    assert file_type_name(gguf.LlamaFileType.MOSTLY_Q4_K_M) == "q4_k_m" and file_type_name(0) == "f32"
