"""The memory model (``sinv_prune.pipeline.memory_model``): its terms against the objects they stand for, and the
``--dry-run`` / pre-load refusal of ``sinv-prune shrink`` and ``prune``."""

from __future__ import annotations

import pytest
import torch
import transformers
from click.testing import CliRunner

from sinv_prune.arch import get_adapter
from sinv_prune.cli import main
from sinv_prune.pipeline import memory_model
from sinv_prune.scoring.consumer_statistics import Statistics
from sinv_prune.surgery import checkpoint

VOCAB = 64


def tiny_llama(**overrides) -> transformers.LlamaForCausalLM:
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8)  # fmt: skip
    config = transformers.LlamaConfig(**{**sizes, **overrides})
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_the_shape_is_the_models_own_sizes():
    model = tiny_llama(num_hidden_layers=4)
    shape = memory_model.shape_of(model.config, type(model), "float32")
    assert shape.model_bytes == sum(t.numel() * 4 for t in (*model.parameters(), *model.buffers()))
    blocks = get_adapter(model).layers()
    assert shape.block_bytes == [sum(t.numel() * 4 for t in (*b.parameters(), *b.buffers())) for b in blocks]
    # o_proj: in = heads x head_dim = 32, out = hidden; down_proj: in = intermediate 48
    assert shape.consumers == [[(32, 32, False), (48, 32, False)]] * 4
    half = memory_model.shape_of(model.config, type(model), "bfloat16")
    assert half.model_bytes * 2 == shape.model_bytes


def test_the_whole_model_statistics_term_is_the_bytes_statistics_allocates():
    model = tiny_llama()
    adapter = get_adapter(model)
    seqs = [torch.randint(0, VOCAB, (16,), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    stats = Statistics(model, adapter, seqs, [False, False, False, True], quiet=True)
    allocated = sum(t.numel() * t.element_size() for pair in stats.fits.values() for f in pair
                    for t in (f.gram, f.cross))  # fmt: skip
    shape = memory_model.shape_of(model.config, type(model), "float32")
    pred = memory_model.predict(shape, "shrink", sequences=4, length=16, layerwise=False)
    assert pred.host_terms["statistics"] == allocated
    # layer-wise in float32: half of it on the host, one layer's worth in the work area
    lw = memory_model.predict(shape, "shrink", sequences=4, length=16, stat_dtype="float32")
    assert lw.host_terms["statistics"] == allocated // 2


def test_refine_adds_a_copy_of_the_model_and_its_refusal_offers_no_offload():
    model = tiny_llama()
    shape = memory_model.shape_of(model.config, type(model), "float32")
    plain, refined = (memory_model.predict(shape, "shrink", sequences=64, length=512, refine=r) for r in (False, True))
    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])  # the copy's tensors
    hidden = 3 * 64 * 512 * model.config.hidden_size * 4  # teacher, student and advanced streams, float32
    assert refined.host_peak - plain.host_peak == weights + hidden
    line = memory_model.refusal(shape, "shrink", None, refined.host_peak - 1, sequences=64, length=512, refine=True)
    assert line and "--offload" not in line and "--sequences 32 or fewer" in line


def test_offload_moves_the_model_off_the_device_and_the_refusal_names_what_fits():
    shape = memory_model.shape_of(tiny_llama(num_hidden_layers=8).config, transformers.LlamaForCausalLM, "float32")
    opts = dict(sequences=8, length=32, device="cuda")
    none = memory_model.predict(shape, "shrink", **opts)
    cpu = memory_model.predict(shape, "shrink", offload="cpu", **opts)
    disk = memory_model.predict(shape, "shrink", offload="disk", **opts)
    block = max(shape.block_bytes)
    assert none.device_terms["model"] == shape.model_bytes
    assert cpu.device_terms["one block"] == block + shape.outside_blocks
    # the model (and prune's new weights, made where the model is) leave the device but one block
    moved = shape.model_bytes + sum(shape.block_bytes) - block - shape.outside_blocks
    assert none.device_peak - cpu.device_peak == moved
    assert cpu.host_terms["model"] == shape.model_bytes and "model" not in disk.host_terms
    assert disk.disk_bytes == shape.model_bytes + none.host_terms["statistics"]
    # a device with room for cpu's peak but not none's: offload cpu
    line = memory_model.refusal(shape, "shrink", cpu.device_peak, 1 << 40, **opts)
    assert line.startswith("predicted peak memory") and "--offload cpu" in line and "\n" not in line
    assert memory_model.refusal(shape, "shrink", none.device_peak, 1 << 40, **opts) is None
    # the host cannot hold the statistics: disk
    line = memory_model.refusal(shape, "shrink", cpu.device_peak, disk.host_peak, offload="cpu", **opts)
    assert "--offload disk" in line
    # disk offload's host peak is the hidden states and one layer's statistics: fewer sequences, where they help
    many = memory_model.predict(shape, "shrink", **{**opts, "sequences": 64, "offload": "disk"})
    fewer = "--calib-sequences {} or fewer"
    line = memory_model.refusal(shape, "shrink", 1 << 40, many.host_peak - 1, offload="disk",
                                sequences_option=fewer, **{**opts, "sequences": 64})  # fmt: skip
    assert "--calib-sequences 32 or fewer" in line
    smaller = memory_model.predict(shape, "shrink", **{**opts, "sequences": 32, "offload": "disk"})
    assert smaller.host_terms["hidden states"] * 2 == many.host_terms["hidden states"]
    # the device's share does not depend on the sequences: nothing fits
    line = memory_model.refusal(shape, "shrink", many.device_peak - 1, 1 << 40, offload="disk",
                                sequences_option=fewer, **{**opts, "sequences": 64})  # fmt: skip
    assert "no offload or calibration size fits" in line


@pytest.fixture
def saved(tmp_path):
    source = tmp_path / "model"
    tiny_llama().save_pretrained(source)
    text = tmp_path / "calib.txt"
    text.write_text("a b c\n" * 50)
    return source, text


def _no_load(monkeypatch):
    """Any weight load fails the test: the refusal must come first."""

    def boom(*args, **kwargs):
        pytest.fail("model weights were loaded before the memory check")

    monkeypatch.setattr(checkpoint, "from_pretrained", boom)
    monkeypatch.setattr(transformers.PreTrainedModel, "from_pretrained", classmethod(boom))


def test_shrink_dry_run_prints_the_prediction_and_loads_nothing(saved, tmp_path, monkeypatch):
    source, text = saved
    _no_load(monkeypatch)
    monkeypatch.setattr(memory_model, "_host_available", lambda: 1 << 40)
    args = ["shrink", source, tmp_path / "out", "--params", "0.2", "--calibration", text, "--dry-run"]
    done = CliRunner().invoke(main, [str(a) for a in args])
    assert done.exit_code == 0, done.output
    shape = memory_model.shape_of_source(str(source))
    pred = memory_model.predict(shape, "shrink", sequences=64, length=512)
    assert f"predicted peak host memory: {memory_model.gib(pred.host_peak)}" in done.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dry_run", [True, False])
def test_shrink_refuses_a_run_that_does_not_fit_before_loading(saved, tmp_path, monkeypatch, dry_run):
    source, text = saved
    shape = memory_model.shape_of_source(str(source))
    pred = memory_model.predict(shape, "shrink", sequences=64, length=512)
    _no_load(monkeypatch)
    monkeypatch.setattr(memory_model, "_host_available", lambda: pred.host_peak - 1)
    args = ["shrink", source, tmp_path / "out", "--params", "0.2", "--calibration", text]
    done = CliRunner().invoke(main, [str(a) for a in args + (["--dry-run"] if dry_run else [])])
    assert done.exit_code == 2, done.output
    error = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and "predicted peak memory" in error[0]
    disk = memory_model.predict(shape, "shrink", sequences=64, length=512, offload="disk")
    assert disk.host_peak <= pred.host_peak - 1 and "use --offload disk" in error[0]  # what it offers fits
    assert not (tmp_path / "out").exists()


def test_prune_dry_run_and_refusal(saved, tmp_path, monkeypatch):
    source, _ = saved
    _no_load(monkeypatch)
    shape = memory_model.shape_of_source(str(source))
    plain = memory_model.predict(shape, "plain", sequences=0, length=0)
    # the model, the new weights of every block (the old held until prune returns), the process's fixed share
    assert plain.host_peak == shape.model_bytes + sum(shape.block_bytes) + memory_model.RUNTIME_BYTES
    args = [str(a) for a in ["prune", source, tmp_path / "out", "--heads", "0:1", "--dry-run"]]
    monkeypatch.setattr(memory_model, "_host_available", lambda: 1 << 40)
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0 and "predicted peak host memory" in done.output, done.output
    monkeypatch.setattr(memory_model, "_host_available", lambda: plain.host_peak - 1)
    done = CliRunner().invoke(main, args[:-1])
    assert done.exit_code == 2 and "predicted peak memory" in done.output, done.output


def test_a_recipe_dry_run_prints_the_prune_stage_memory_and_refuses_what_does_not_fit(tmp_path, monkeypatch):
    from test_pipeline import TINY, invoke, recipe_file

    from sinv_prune.pipeline import estimate
    from sinv_prune.pipeline.recipe import validate_recipe

    spec = {**TINY, "name": "auto", "prune": {"arms": [{"auto": {"params": 0.2, "budget": 4, "batches": 8}},
                                                         {"criterion": "magnitude", "amount": 2}]}}  # fmt: skip
    path = recipe_file(tmp_path, spec)
    monkeypatch.setattr(estimate, "run_probe", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no probe")))
    monkeypatch.setattr(memory_model, "_host_available", lambda: 1 << 40)
    done = invoke(path, "--dry-run", "--device", "cpu")
    assert done.exit_code == 0, done.output
    assert "prune stage, memory of arm auto-p0.2 (shrink, the largest):" in done.output
    # the auto arm's shrink, as the memory model predicts it from the recipe's own model
    label, task, pred, flag, _ = estimate.prune_memory(validate_recipe(spec), "cpu")
    assert (label, task, flag) == ("auto-p0.2", "shrink", "auto.batches")
    assert f"predicted peak host memory: {memory_model.gib(pred.host_peak)}" in done.output
    monkeypatch.setattr(memory_model, "_host_available", lambda: pred.host_peak - 1)
    done = invoke(path, "--dry-run", "--device", "cpu")
    assert done.exit_code == 2, done.output
    assert "predicted peak memory" in done.output and "offload" not in done.output.split("predicted peak memory")[-1]
