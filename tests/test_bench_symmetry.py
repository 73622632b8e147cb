"""scripts/bench_symmetry.py: the output structure of a --quick run (not its timings or numbers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import wikitext

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_symmetry.py"
PNG = b"\x89PNG\r\n\x1a\n"


def run(*args: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_quick_synthetic_json_table_and_plot(tmp_path):
    out = run("--quick", "--data", "synthetic", "--steps", "4", "--measure-every", "2", "--seeds", "2",
              "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png"))  # fmt: skip
    lines = out.splitlines()
    assert lines[0].startswith("$ python ") and "--quick" in lines[0] and "--data synthetic" in lines[0]
    assert "synthetic corpus" in out
    assert "optimizer     breaking" in out and "Effect of breaking" in out and "Mean C_Q over all heads" in out

    result = json.loads((tmp_path / "r.json").read_text())
    for key in ("command", "argv", "machine", "data", "model", "settings", "runs", "summary", "breaking_effect",
                "table", "plot", "total_seconds"):  # fmt: skip
        assert key in result, key
    assert result["data"]["kind"] == "synthetic" and result["settings"]["quick"] is True
    assert result["table"] in out
    runs = result["runs"]
    assert len(runs) == 3 * 2 * 2  # optimizers x breaking x seeds
    assert {(r["optimizer"], r["breaking"], r["seed"]) for r in runs} == {
        (o, b, s) for o in ("adamw", "sgd", "ecd") for b in (False, True) for s in (0, 1)
    }
    tokens = {result["settings"]["tokens_per_run"]}
    assert tokens == {4 * result["settings"]["batch"] * result["settings"]["seq_len"]}
    for r in runs:
        assert r["trajectory"]["step"] == [0, 2, 4]
        assert len(r["trajectory"]["C_Q_mean"]) == 3 and r["trajectory"]["train_loss"][0] is None
        assert 0 < r["C_Q_end"] < 1 and r["eval_loss"] > 0
        assert len(r["C_Q_end_per_layer"]) == result["model"]["layers"]
        assert r["clip"] is None if r["optimizer"] == "ecd" else r["clip"] == 1.0
    assert [(s["optimizer"], s["breaking"]) for s in result["summary"]] == [
        (o, b) for o in ("adamw", "sgd", "ecd") for b in (False, True)
    ]
    state = {s["optimizer"]: s["state_bytes_per_param"] for s in result["summary"]}
    assert state == {"adamw": pytest.approx(8.0, abs=0.01), "sgd": 4.0, "ecd": 4.0}
    assert all(s["eval_loss_std"] is not None for s in result["summary"])  # two seeds
    assert [e["optimizer"] for e in result["breaking_effect"]] == ["adamw", "sgd", "ecd"]
    assert all(e["n"] == 2 for e in result["breaking_effect"])
    assert result["plot"] == str(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == PNG

    # --report re-prints the tables of a finished run from its JSON, without training
    again = run("--report", str(tmp_path / "r.json"), "--plot", str(tmp_path / "again.png"))
    assert result["table"] in again and result["command"] in again
    assert (tmp_path / "again.png").read_bytes()[:8] == PNG


@pytest.mark.slow
def test_quick_on_wikitext_says_train_valid_eval_test(tmp_path):
    wikitext("valid"), wikitext("test")  # skip where the text is absent
    out = run("--quick", "--data", "wikitext", "--optimizers", "ecd", "--breaking", "on", "--steps", "2",
              "--measure-every", "1", "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert "trained on valid.txt, evaluated on test.txt" in out
    assert "Final loss on WikiText-2 test.txt (model trained on WikiText-2 valid.txt)" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["data"]["train"] == "WikiText-2 valid.txt" and result["data"]["eval"] == "WikiText-2 test.txt"
    assert [(r["optimizer"], r["breaking"]) for r in result["runs"]] == [("ecd", True)]
    assert result["plot"] is None and result["breaking_effect"] == []


def _module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_symmetry", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_presets_and_device_options():
    """--preset nanogpt fills nanoGPT's small-GPT shape (explicit options still win); --device is validated."""
    import torch

    bench = _module()
    toy = bench.parse_args([])
    assert (toy.preset, toy.device, toy.layers, toy.d_model, toy.adamw_lr) == ("toy", "cpu", 2, 128, 2e-3)
    nano = bench.parse_args(["--preset", "nanogpt", "--seeds", "1"])
    assert (nano.layers, nano.heads, nano.d_model, nano.seq_len, nano.vocab) == (6, 6, 384, 256, 8192)
    assert (nano.steps, nano.batch, nano.seeds, nano.adamw_lr) == (1000, 16, 1, 1e-3)
    assert bench.parse_args(["--device", "auto"]).device == ("cuda" if torch.cuda.is_available() else "cpu")
    bad = [["--preset", "nanogpt", "--quick"], ["--device", "tpu"]]
    if not torch.cuda.is_available():
        bad.append(["--device", "cuda"])
    for argv in bad:
        with pytest.raises(SystemExit) as err:
            bench.parse_args(argv)
        assert err.value.code == 2


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_quick_on_cuda(tmp_path):
    out = run("--quick", "--data", "synthetic", "--device", "cuda", "--steps", "3", "--measure-every", "3",
              "--json", str(tmp_path / "r.json"))  # fmt: skip
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["settings"]["device"] == "cuda" and result["machine"]["gpu"] and "device cuda" in out
    assert all(r["eval_loss"] > 0 and 0 < r["C_Q_end"] < 1 for r in result["runs"])
