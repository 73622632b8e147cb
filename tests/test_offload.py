"""Offload (issue 34): pruning models whose blocks live in host RAM or on disk behind accelerate's hooks.

Each offloaded model is pruned next to an in-memory copy of the same model with the same plan; the
cut weights (read back through the hooks' weights maps), the outputs and the saved-and-reloaded
checkpoints must agree. On this CPU-only machine the execution device is the CPU: ``offload="cpu"``
has nothing to move there, so the host-RAM route is exercised through ``accelerate.cpu_offload``
(a hook per module holding weights) and the disk route through :func:`apply_offload` (one hook per
block) and through a ``device_map`` mixing both.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from accelerate import cpu_offload
from conftest import model_inputs, model_output, tiny_model
from test_compensation import calibration
from test_experts import tiny_moe

import sinv_prune
from sinv_prune.data import train_tokenizer
from sinv_prune.surgery.offload import apply_offload, is_offloaded, offload_device_map, offloaded_reason

PLAN_LLAMA = {"heads": {0: [1, 4]}, "mlp": {1: [0, 3, 5, 7, 11]}, "layers": [2]}
PLAN_MOE = {"heads": {0: [0, 2]}, "mlp": {1: [0, 1, 2]}, "experts": {2: [1, 4]}}


def offloaded(model, how: str, tmp_path):
    """``model`` with its weights behind accelerate's offload hooks, ``how``: cpu_offload, disk or mixed."""
    if how == "cpu_offload":
        return cpu_offload(model, execution_device="cpu")
    if how == "disk":
        return apply_offload(model, "disk", device="cpu", folder=tmp_path / "offload")
    from accelerate import dispatch_model

    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu",
                  "lm_head": "cpu"}  # fmt: skip
    return dispatch_model(model, device_map, offload_dir=str(tmp_path / "mixed"))


def real_state(model) -> dict[str, torch.Tensor]:
    """Every weight of ``model`` as it really is, offloaded ones read from their hooks' weights maps."""
    from transformers.integrations.accelerate import load_offloaded_parameter

    return {name: (load_offloaded_parameter(model, name) if t.device.type == "meta" else t).detach().clone()
            for name, t in model.state_dict().items()}  # fmt: skip


def assert_same(pruned, reference, inputs, tmp_path, atol: float = 0.0) -> None:
    """Same weights, same outputs (to ``atol``: a weight read from a file may sit at another alignment, where
    the CPU's matmul kernels round differently), and the saved checkpoint reloads to the same logits."""
    mine, theirs = real_state(pruned), real_state(reference)
    assert mine.keys() == theirs.keys()
    for name in theirs:
        assert mine[name].shape == theirs[name].shape, name
        torch.testing.assert_close(mine[name], theirs[name], rtol=0, atol=0, msg=name)
    expected = model_output(reference, inputs)
    torch.testing.assert_close(model_output(pruned, inputs), expected, rtol=0, atol=atol)
    pruned.save_pretrained(tmp_path / "saved")
    reloaded = sinv_prune.from_pretrained(tmp_path / "saved").eval()
    assert not is_offloaded(reloaded)
    torch.testing.assert_close(model_output(reloaded, inputs), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("how", ["cpu_offload", "disk", "mixed"])
def test_offloaded_llama_prunes_like_in_memory(how, tmp_path):
    base = tiny_model("llama")
    reference, model = copy.deepcopy(base), offloaded(copy.deepcopy(base), how, tmp_path)
    assert is_offloaded(model) and any(p.device.type == "meta" for p in model.parameters())
    sinv_prune.prune(reference, PLAN_LLAMA)
    summary = sinv_prune.prune(model, PLAN_LLAMA)
    assert summary.params_after == sinv_prune.count_parameters(reference)
    assert any(p.device.type == "meta" for p in model.parameters())  # still offloaded after the cut
    again = {"heads": {0: [0, 2]}, "layers": [1]}  # pruning composes: current numbering, blocks renumbered
    sinv_prune.prune(reference, again)
    sinv_prune.prune(model, again)
    assert_same(model, reference, model_inputs(), tmp_path)


@pytest.mark.parametrize("how", ["cpu_offload", "disk"])
def test_offloaded_llama_compensates_like_in_memory(how, tmp_path):
    """OBS chooses the same heads and channels and refits to the same weights (held-out guard included)."""
    base = tiny_model("llama")
    reference, model = copy.deepcopy(base), offloaded(copy.deepcopy(base), how, tmp_path)
    plan = {"heads": {0: [1, 4], 1: [0, 3]}, "mlp": {0: [2, 9, 17], 1: [0, 3, 5, 7]}}
    expected = sinv_prune.prune(reference, plan, calibration=calibration(), compensate="obs", ridge=0.01)
    summary = sinv_prune.prune(model, plan, calibration=calibration(), compensate="obs", ridge=0.01)
    assert summary.to_dict()["layers"] == expected.to_dict()["layers"]
    assert summary.to_dict()["mlp"] == expected.to_dict()["mlp"]
    assert summary.compensation.kept == expected.compensation.kept
    assert sum(f.refit for f in summary.compensation.layers) == sum(f.refit for f in expected.compensation.layers)
    assert_same(model, reference, model_inputs(), tmp_path)


@pytest.mark.parametrize("how", ["cpu_offload", "disk"])
def test_offloaded_moe_prunes_like_in_memory(how, tmp_path):
    base = tiny_moe("qwen3_moe")
    reference = copy.deepcopy(base)
    model = cpu_offload(copy.deepcopy(base), "cpu") if how == "cpu_offload" else offloaded(
        copy.deepcopy(base), "disk", tmp_path)  # fmt: skip
    sinv_prune.prune(reference, PLAN_MOE)
    sinv_prune.prune(model, PLAN_MOE)
    assert_same(model, reference, model_inputs(), tmp_path)


def test_failed_prune_leaves_offloaded_maps_as_they_were(tmp_path, monkeypatch):
    """An error part-way through (after blocks were cut and written back) restores the weights maps."""
    import sinv_prune.surgery.removal as removal

    model = offloaded(tiny_model("llama"), "disk", tmp_path)
    inputs = model_inputs()
    before, out = real_state(model), model_output(model, inputs)

    def fail(*args, **kwargs):
        raise RuntimeError("injected")

    monkeypatch.setattr(removal, "drop_layers", fail)
    with pytest.raises(RuntimeError, match="injected"):
        sinv_prune.prune(model, PLAN_LLAMA)
    after = real_state(model)
    assert after.keys() == before.keys()
    for name in before:
        torch.testing.assert_close(after[name], before[name], rtol=0, atol=0, msg=name)
    torch.testing.assert_close(model_output(model, inputs), out, rtol=0, atol=0)


def test_prune_offload_argument_and_device_map(tmp_path):
    """``prune(..., offload="disk")`` offloads first: every block is behind a hook, the rest is not."""
    base = tiny_model("llama")
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    assert offload_device_map(model, "disk", "cpu") == {
        "model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "disk", "model.layers.2": "disk",
        "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu",
    }  # fmt: skip
    sinv_prune.prune(reference, PLAN_LLAMA)
    sinv_prune.prune(model, PLAN_LLAMA, offload="disk", offload_folder=tmp_path / "f")
    assert all(p.device.type == "meta" for p in model.model.layers.parameters())
    assert model.model.embed_tokens.weight.device.type == "cpu"
    assert list((tmp_path / "f" / "sinv_prune_cuts").glob("*.safetensors"))  # the cut blocks, in new files
    assert_same(model, reference, model_inputs(), tmp_path)
    with pytest.raises(ValueError, match="offload must be one of none, cpu, disk"):
        sinv_prune.prune(copy.deepcopy(base), PLAN_LLAMA, offload="gpu")
    with pytest.raises(ValueError, match="only used with offload='disk'"):
        sinv_prune.prune(copy.deepcopy(base), PLAN_LLAMA, offload="cpu", offload_folder=tmp_path)


def test_meta_weights_without_a_hook_are_refused():
    model = tiny_model("llama")
    proj = model.model.layers[1].mlp.up_proj
    proj.weight = torch.nn.Parameter(torch.empty_like(proj.weight, device="meta"))
    assert "no accelerate offload hook holds it" in offloaded_reason(model)
    refusal = r"cannot prune this model: model\.layers\.1\.mlp\.up_proj\.weight is on the meta device"
    with pytest.raises(ValueError, match=refusal):
        sinv_prune.prune(model, PLAN_LLAMA)


@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_from_pretrained_offloaded_loads_blocks_off_the_device(mode, tmp_path):
    """Loading with ``offload="disk"`` leaves every block on ``meta`` (read in place from the safetensors)."""
    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "src")
    inputs = model_inputs()
    folder = tmp_path / "off" if mode == "disk" else None
    model = sinv_prune.from_pretrained(tmp_path / "src", offload=mode, offload_folder=folder,
                                       attn_implementation="eager").eval()  # fmt: skip
    blocks = list(model.model.layers.parameters())
    assert all(p.device.type == ("meta" if mode == "disk" else "cpu") for p in blocks)
    torch.testing.assert_close(model_output(model, inputs), model_output(base, inputs), rtol=0, atol=0)
    reference = copy.deepcopy(base)
    sinv_prune.prune(reference, PLAN_LLAMA)
    sinv_prune.prune(model, PLAN_LLAMA)
    assert_same(model, reference, inputs, tmp_path)


def test_from_pretrained_passes_a_device_map_and_its_offload_folder_to_transformers(tmp_path):
    tiny_model("llama").save_pretrained(tmp_path / "src")
    device_map = {name: "cpu" for name in ("model.embed_tokens", "model.layers.0", "model.layers.2", "model.norm",
                                           "model.rotary_emb", "lm_head")}  # fmt: skip
    device_map["model.layers.1"] = "disk"
    model = sinv_prune.from_pretrained(tmp_path / "src", device_map=device_map, offload_folder=tmp_path / "off")
    assert model.model.layers[1].mlp.up_proj.weight.device.type == "meta" and is_offloaded(model)
    with pytest.raises(ValueError, match="do not also give device_map"):
        sinv_prune.from_pretrained(tmp_path / "src", device_map=device_map, offload="disk")


def test_cli_prune_and_shrink_offload(tmp_path):
    """``sinv-prune prune --offload disk`` and ``shrink --offload disk`` save the same models as without."""
    from click.testing import CliRunner

    from sinv_prune.cli import main

    base = tiny_model("llama")
    base.save_pretrained(tmp_path / "src")
    runner = CliRunner()
    args = ["prune", str(tmp_path / "src"), "--heads", "0:1,4", "--layers", "2"]
    plain = runner.invoke(main, [*args, str(tmp_path / "plain")])
    assert plain.exit_code == 0, plain.output
    offloaded_run = runner.invoke(main, [*args, str(tmp_path / "disk"), "--offload", "disk"])
    assert offloaded_run.exit_code == 0, offloaded_run.output
    assert not list(tmp_path.glob(".disk.offload.*"))  # the temporary offload folder is gone
    inputs = model_inputs()
    expected = model_output(sinv_prune.from_pretrained(tmp_path / "plain"), inputs)
    torch.testing.assert_close(model_output(sinv_prune.from_pretrained(tmp_path / "disk"), inputs), expected,
                               rtol=0, atol=0)  # fmt: skip
    bad = runner.invoke(main, [*args, str(tmp_path / "x"), "--offload-folder", str(tmp_path / "f")])
    assert bad.exit_code != 0 and "--offload-folder is only used with --offload disk" in bad.output
    lines = [" ".join(f"w{(i * 7 + j) % 80}" for j in range(30)) for i in range(200)]
    text = tmp_path / "text.txt"
    text.write_text("\n".join(lines))
    train_tokenizer(lines, "word", vocab_size=base.config.vocab_size).save_pretrained(tmp_path / "src")
    shrink = ["shrink", str(tmp_path / "src"), "--params", "0.2", "--calibration", str(text), "--budget", "3",
              "--sequences", "8", "--length", "32", "-q"]  # fmt: skip
    runs = {mode: runner.invoke(main, [*shrink[:2], str(tmp_path / f"s-{mode}"), *shrink[2:], "--offload", mode])
            for mode in ("none", "disk")}  # fmt: skip
    for mode, done in runs.items():
        assert done.exit_code == 0, (mode, done.output)
    assert not list(tmp_path.glob(".s-disk.offload.*"))
    (a, b) = (json.loads((tmp_path / f"s-{m}" / "shrink.json").read_text()) for m in ("none", "disk"))
    assert a["plan"] == b["plan"] and a["fitness"] == pytest.approx(b["fitness"], rel=1e-6)
    torch.testing.assert_close(model_output(sinv_prune.from_pretrained(tmp_path / "s-disk"), inputs),
                               model_output(sinv_prune.from_pretrained(tmp_path / "s-none"), inputs))  # fmt: skip


def _shrink_seqs(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return list(torch.randint(1, vocab, (12, 40), generator=g))


@pytest.mark.parametrize(("family", "how"), [("llama", "cpu_offload"), ("llama", "disk"), ("llama", "mixed"),
                                             ("qwen3_moe", "disk")])  # fmt: skip
def test_offloaded_model_shrinks_like_in_memory(family, how, tmp_path):
    """The same search (plan, seeds' fitness, held-out perplexities) and the same built weights, offloaded maps
    written through; the offloaded result saves and reloads to the same logits."""
    base = tiny_model("llama") if family == "llama" else tiny_moe("qwen3_moe")
    reference, model = copy.deepcopy(base), offloaded(copy.deepcopy(base), how, tmp_path)
    options = {"calibration": _shrink_seqs(base.config.vocab_size), "budget": 10, "multiple": 4, "quiet": True}
    expected = sinv_prune.shrink(reference, 0.3, **options)
    got = sinv_prune.shrink(model, 0.3, store="disk", **options)
    assert got.plan == expected.plan and got.chosen == expected.chosen
    assert got.history == pytest.approx(expected.history, rel=1e-5, abs=1e-9)
    assert got.heldout_ppl == pytest.approx(expected.heldout_ppl, rel=1e-5)
    assert got.params_after == expected.params_after and is_offloaded(model)
    assert any(p.device.type == "meta" for p in model.parameters())  # still offloaded after the build
    assert_same(model, reference, model_inputs(), tmp_path, atol=1e-6)  # weights bit for bit


def test_shrink_refuses_refine_on_offloaded_blocks(tmp_path):
    model = offloaded(tiny_model("llama"), "disk", tmp_path)
    with pytest.raises(ValueError, match="refine builds a copy of the model; it cannot run on offloaded blocks"):
        sinv_prune.shrink(model, 0.3, calibration=_shrink_seqs(model.config.vocab_size), refine=True, quiet=True)


def test_recipe_device_map_that_offloads_is_still_refused(tmp_path):
    """Accelerate's offload now prunes, but a recipe run also scores and fine-tunes, which read weights in place."""
    from sinv_prune.pipeline.model_settings import unloadable_reason

    model = offloaded(tiny_model("llama"), "disk", tmp_path)
    assert "it offloads weights" in unloadable_reason(model)
    assert unloadable_reason(tiny_model("llama")) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["cpu", "disk"])
def test_offload_next_to_a_gpu_keeps_the_blocks_off_it(mode, tmp_path):
    """On a GPU, only the embeddings, norm and head live there; the blocks come for their turn and go back."""
    base = tiny_model("llama")
    reference = copy.deepcopy(base)
    model = copy.deepcopy(base).cuda()
    folder = tmp_path / "f" if mode == "disk" else None
    sinv_prune.prune(reference, PLAN_LLAMA)
    sinv_prune.prune(model, PLAN_LLAMA, offload=mode, offload_folder=folder)
    assert all(p.device.type == "meta" for p in model.model.layers.parameters())
    assert model.model.embed_tokens.weight.device.type == "cuda"
    inputs = model_inputs()
    got = model_output(model, {k: v.cuda() for k, v in inputs.items()}).cpu()
    torch.testing.assert_close(got, model_output(reference, inputs), atol=1e-4, rtol=1e-4)
    base.save_pretrained(tmp_path / "src")
    again = tmp_path / "g" if mode == "disk" else None
    loaded = sinv_prune.from_pretrained(tmp_path / "src", offload=mode, offload_folder=again)
    assert all(p.device.type == "meta" for p in loaded.model.layers.parameters())
    assert loaded.model.embed_tokens.weight.device.type == "cuda"
