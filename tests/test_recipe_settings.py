"""Recipe model settings end to end: dtype, device_map, attn_implementation, gradient checkpointing, LoRA."""

from __future__ import annotations

import importlib.util
import inspect
import json
import warnings

import pytest
import torch
import transformers
import yaml
from conftest import model_inputs, model_output, reload_in_fresh_process, tiny_model
from safetensors import safe_open
from test_pipeline import TINY, StopAfterFirstSave, invoke, recipe_file
from transformers import TrainerCallback

import sinv_prune
from sinv_prune import data as data_mod
from sinv_prune.pipeline import estimate
from sinv_prune.pipeline import stages as pipeline
from sinv_prune.pipeline.model_settings import default_target_modules, input_device, load_kwargs, unloadable_reason
from sinv_prune.pipeline.recipe import RecipeError, recipe_to_yaml, validate_recipe
from sinv_prune.pipeline.starting_model import build_model
from sinv_prune.pipeline.training import run_trainer

LLAMA = dict(
    vocab_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=32, head_dim=8,
    intermediate_size=48, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
)  # fmt: skip


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny random LLaMA saved as a float32 checkpoint (the run's 'pretrained' starting model)."""
    path = tmp_path_factory.mktemp("pretrained") / "llama"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).save_pretrained(path)
    return path


def recipe(model_dir, model=None, finetune=None, arms=None) -> dict:
    return {
        "name": "settings",
        "model": {"path": str(model_dir), **(model or {})},
        "data": {
            "synthetic": {"seed": 0, "num_train": 120, "num_valid": 20, "num_test": 20},
            "tokenizer": {"kind": "word", "vocab_size": 64},
            "seq_len": 32,
        },
        "score": {"batches": 1, "batch_size": 4},
        "prune": {"arms": arms or [{"name": "stock", "criterion": "magnitude", "amount": 4, "mode": "uniform"}]},
        "finetune": {"max_steps": 2, "batch_size": 4, "learning_rate": 0.01, **(finetune or {})},
        "evaluate": {"speed": False, "batch_size": 4},
        "report": {"plots": False},
    }


def tensors(directory) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


def test_bfloat16_on_an_explicit_cpu_device_map_loads_prunes_finetunes_and_saves_in_bfloat16(tmp_path, pretrained):
    data = recipe(pretrained, model={"dtype": "bfloat16", "device_map": {"": "cpu"}, "attn_implementation": "sdpa"})
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out", "--quiet")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    for stage in ("pruned", "finetuned"):
        saved = tensors(out / "arms" / "stock" / stage)
        assert {t.dtype for t in saved.values() if t.is_floating_point()} == {torch.bfloat16}, stage
        assert json.loads((out / "arms" / "stock" / stage / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in tensors(out / "base").values()} == {torch.bfloat16}
    reloaded = sinv_prune.from_pretrained(out / "arms" / "stock" / "finetuned")
    assert reloaded.dtype == torch.bfloat16 and reloaded.config.num_attention_heads == 2  # uniform cut: stock route
    pruned, tuned = tensors(out / "arms" / "stock" / "pruned"), tensors(out / "arms" / "stock" / "finetuned")
    assert not torch.equal(
        pruned["model.layers.0.self_attn.q_proj.weight"], tuned["model.layers.0.self_attn.q_proj.weight"]
    )
    results = json.loads((out / "results.json").read_text())
    assert results["run"]["device"] == "cpu"
    assert all(torch.isfinite(torch.tensor(a["perplexity"])) for a in [results["baseline"], *results["arms"]])


def test_model_settings_reach_the_loaded_model(pretrained):
    spec = recipe(pretrained, model={"dtype": "float16", "device_map": {"": "cpu"}, "attn_implementation": "eager"})
    assert load_kwargs(validate_recipe(spec)) == {
        "dtype": torch.float16, "device_map": {"": "cpu"}, "attn_implementation": "eager"}  # fmt: skip
    model = build_model(validate_recipe(spec))
    assert model.dtype == torch.float16 and {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.config._attn_implementation == "eager"
    default = build_model(validate_recipe(recipe(pretrained)))
    assert default.dtype == torch.float32 and getattr(default, "hf_device_map", None) is None  # auto: the checkpoint's
    scratch = build_model(validate_recipe({**TINY, "model": {**TINY["model"], "dtype": "bfloat16"}}), vocab_size=50)
    assert scratch.dtype == torch.bfloat16
    eager = {**TINY["model"], "attn_implementation": "eager"}
    assert build_model(validate_recipe({**TINY, "model": eager}), vocab_size=50).config._attn_implementation == "eager"
    assert input_device(validate_recipe(spec)) == "cpu"
    assert input_device(validate_recipe(recipe(pretrained, model={"device_map": {"a": 1, "b": "cpu"}}))) == "cuda:1"
    assert input_device(validate_recipe(recipe(pretrained, model={"device_map": "auto"}))) is None


def test_lora_finetune_saves_a_merged_plain_model_that_reloads_through_every_route(tmp_path, pretrained):
    arms = [
        {"name": "stock", "criterion": "magnitude", "amount": 4, "mode": "uniform"},  # equal heads: stock route
        {"name": "remote", "criterion": "magnitude", "amount": 2, "layout": "kv_groups"},  # one layer: remote code
    ]
    finetune = {
        "learning_rate": 0.05,
        "gradient_checkpointing": True,
        "lora": {"r": 4, "alpha": 8},
        "distill": {"teacher": "base", "alpha": 0.5},
    }
    result = invoke(recipe_file(tmp_path, recipe(pretrained, finetune=finetune, arms=arms)), "--output",
                    tmp_path / "out", "--quiet")  # fmt: skip
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    state = json.loads((out / "state.json").read_text())
    inputs = model_inputs()
    jobs, expected = {}, {}
    for name, routes in (("stock", ["sinv", "stock", "plain:AutoModelForCausalLM"]),
                         ("remote", ["sinv", "auto:AutoModelForCausalLM"])):  # fmt: skip
        arm = out / "arms" / name
        assert state["arms"][name]["finetune"]["lora"]["r"] == 4 and state["arms"][name]["finetune"]["distill"]
        pruned, tuned = tensors(arm / "pruned"), tensors(arm / "finetuned")
        assert sorted(tuned) == sorted(pruned)  # no lora_A / lora_B / base_model.model. keys
        assert not any("lora" in k or "base_model" in k for k in tuned)
        assert sorted(p.name for p in (arm / "finetuned").iterdir() if "adapter" in p.name) == []
        assert "peft" not in (arm / "finetuned" / "config.json").read_text()
        for key in pruned:
            changed = not torch.equal(pruned[key], tuned[key])
            assert changed == key.endswith("proj.weight"), key  # adapters on every projection, nothing else
        model = sinv_prune.from_pretrained(arm / "finetuned", attn_implementation="eager").eval()
        assert type(model).__name__ == ("LlamaForCausalLM" if name == "stock" else "SinvPrunedLlamaForCausalLM")
        expected[name] = model_output(model, inputs)
        jobs[name] = (arm / "finetuned", routes)
    results = reload_in_fresh_process(tmp_path, inputs, jobs)
    for (name, route), got in results.items():
        assert not got["missing"] and not got["unexpected"] and not got["mismatched"], (name, route)
        torch.testing.assert_close(got["main"], expected[name], msg=f"{name} via {route}")


def test_a_lora_finetune_resumes_from_its_adapter_checkpoint(tmp_path, pretrained, monkeypatch):
    data = recipe(pretrained, finetune={"save_every": 1, "lora": {"r": 2, "target_modules": ["q_proj", "v_proj"]}})
    real_trainer = pipeline.run_trainer

    def stops(*args, **kwargs):
        return real_trainer(*args, **{**kwargs, "callbacks": [StopAfterFirstSave()]})

    monkeypatch.setattr(pipeline, "run_trainer", stops)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_recipe(validate_recipe(data), tmp_path / "out", quiet=True)
    monkeypatch.undo()
    saved = tmp_path / "out" / "arms" / "stock" / "checkpoints" / "checkpoint-1"
    assert (saved / "adapter_model.safetensors").is_file()  # the Trainer saved the adapters only
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out", "--quiet", "--resume")
    assert result.exit_code == 0, result.output
    assert "resuming training from" in (tmp_path / "out" / "run.log").read_text()
    state = json.loads((tmp_path / "out" / "state.json").read_text())
    assert state["arms"]["stock"]["finetune"]["steps"] == 2
    pruned, tuned = (tensors(tmp_path / "out" / "arms" / "stock" / d) for d in ("pruned", "finetuned"))
    assert sorted(tuned) == sorted(pruned)
    changed = sorted(k for k in pruned if not torch.equal(pruned[k], tuned[k]))
    assert changed == [f"model.layers.{i}.self_attn.{m}_proj.weight" for i in range(2) for m in "qv"]


def test_default_lora_targets_are_every_attention_and_mlp_projection():
    config = transformers.LlamaConfig(**LLAMA)
    names = default_target_modules(transformers.LlamaForCausalLM(config))
    per_layer = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]  # fmt: skip
    assert sorted(names) == sorted(f"model.layers.{i}.{m}" for i in range(2) for m in per_layer)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=8, vocab_size=16))
    assert default_target_modules(gpt2) == ["transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
                                            "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj"]  # fmt: skip


class SeeArgs(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.args, self.checkpointing = args, model.is_activation_checkpointing


def test_gradient_checkpointing_reaches_the_trainer(tmp_path):
    corpus = data_mod.synthetic_corpus(num_train=40, num_valid=4, num_test=4, seed=0)
    tokenizer = data_mod.train_tokenizer(corpus["train"], kind="word", vocab_size=40)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64))
    spec = validate_recipe({**TINY, "train": {**TINY["train"], "max_steps": 1, "gradient_checkpointing": True}}).train
    seen = SeeArgs()
    blocks = data_mod.lm_blocks(data_mod.token_ids(corpus["train"], tokenizer), 16)
    run_trainer(model, tokenizer, blocks, None, spec, tmp_path / "ckpt", mlm=False, seed=0, device="cpu", quiet=True,
                callbacks=[seen])  # fmt: skip
    assert seen.args.activation_checkpointing and seen.checkpointing
    assert validate_recipe(TINY).finetune.gradient_checkpointing is False  # off unless asked


def test_offloaded_weights_stop_the_run_with_the_surgery_refusal(tmp_path, pretrained, monkeypatch):
    def offloaded(recipe, **kwargs):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
        proj = model.model.layers[1].self_attn.q_proj
        proj.weight = torch.nn.Parameter(torch.empty_like(proj.weight, device="meta"))  # as accelerate offloads
        return model

    model = offloaded(None)
    reason = unloadable_reason(model)
    assert reason.startswith("model.device_map: cannot prune this placement: ") and "meta device" in reason
    monkeypatch.setattr(pipeline, "build_model", offloaded)
    result = invoke(recipe_file(tmp_path, recipe(pretrained, model={"device_map": "auto"})), "--output",
                    tmp_path / "out", "--quiet")  # fmt: skip
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"error: {reason}"]


SCRATCH_BAD = [
    ({"model": {**TINY["model"], "dtype": "int8"}}, "model.dtype: Input should be 'auto', 'bfloat16'"),
    ({"model": {**TINY["model"], "attn_implementation": "fast"}},
     "model.attn_implementation: unknown attention implementation 'fast'; choose from eager, sdpa"),
    ({"model": {**TINY["model"], "device_map": "cpu"}}, "model: 'device_map' needs 'path'"),
    ({"train": {**TINY["train"], "lora": {"r": 4}}}, "train.lora: LoRA is only for finetune"),
    ({"finetune": {**TINY["finetune"], "lora": {}, "symmetry_breaking": {}}}, "finetune: lora: symmetry_breaking"),
    ({"finetune": {**TINY["finetune"], "lora": {"r": 0}}}, "finetune.lora.r: Input should be greater than 0"),
    ({"finetune": {**TINY["finetune"], "lora": {"target_modules": ["c_attn", "nope"]}}},
     "finetune.lora.target_modules[1]: the model has no module 'nope'"),
    ({"finetune": {**TINY["finetune"], "gradient_checkpointing": "sometimes"}},
     "finetune.gradient_checkpointing: Input should be a valid boolean"),
]  # fmt: skip
PRETRAINED_BAD = [
    ({"device_map": "gpu9"}, "model.device_map: 'gpu9' is not a device; choose from auto, balanced"),
    ({"device_map": {"model.layers.1": "disk", "": "cpu"}}, "model.device_map: 'model.layers.1': 'disk' offload"),
    ({"device_map": {}}, "model.device_map: an empty mapping places nothing"),
]
if not torch.cuda.is_available():
    PRETRAINED_BAD.append(({"device_map": {"": 0}}, "model.device_map: cuda:0 is not here (0 CUDA devices)"))
if importlib.util.find_spec("flash_attn") is None:
    PRETRAINED_BAD.append(({"attn_implementation": "flash_attention_2"}, "model.attn_implementation: "))


@pytest.mark.parametrize(("change", "message"), SCRATCH_BAD)
def test_bad_settings_exit_2_with_one_line_and_no_output(tmp_path, change, message):
    assert_refused(tmp_path, {**TINY, **change}, message)


@pytest.mark.parametrize(("model", "message"), PRETRAINED_BAD)
def test_bad_placements_exit_2_with_one_line_and_no_output(tmp_path, pretrained, model, message):
    assert_refused(tmp_path, recipe(pretrained, model=model), message)


def assert_refused(tmp_path, data: dict, message: str) -> None:
    result = invoke(recipe_file(tmp_path, data), "--output", tmp_path / "out")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {message}"), lines
    assert not (tmp_path / "out").exists()


def test_a_device_map_under_a_multi_process_launch_is_refused(tmp_path, pretrained, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    result = invoke(recipe_file(tmp_path, recipe(pretrained, model={"device_map": "auto"})), "--output", tmp_path / "o")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: model.device_map: one model split over devices cannot run in a multi-process launch "
        "(WORLD_SIZE=2, torchrun / accelerate launch); drop device_map or run one process"
    ]


def test_dry_run_estimate_uses_the_recipe_dtype(tmp_path, pretrained):
    result = invoke(recipe_file(tmp_path), "--output", tmp_path / "out", "--dry-run", "--set", "model.dtype=bfloat16")
    assert result.exit_code == 0, result.output
    assert "thread(s), bfloat16;" in result.output
    config = transformers.AutoConfig.from_pretrained(pretrained)
    assert estimate._dtype(validate_recipe(recipe(pretrained, model={"dtype": "float16"})), config) == torch.float16
    assert estimate._dtype(validate_recipe(recipe(pretrained)), config) == torch.float32  # auto: the config's


def test_resolved_recipe_shows_the_settings():
    resolved = yaml.safe_load(recipe_to_yaml(validate_recipe(TINY)))
    assert resolved["model"]["dtype"] == "auto" and resolved["finetune"]["gradient_checkpointing"] is False


SPLIT = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
         "lm_head": 1}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_surgery_keeps_each_layer_on_its_device_in_a_split_model(pretrained):
    split = sinv_prune.from_pretrained(pretrained, device_map=SPLIT, attn_implementation="eager")
    reference = sinv_prune.from_pretrained(pretrained, attn_implementation="eager")
    before = {name: p.device for name, p in split.named_parameters()}
    assert {d.index for d in before.values()} == {0, 1}
    heads = {0: [0, 1], 1: [1, 3]}
    sinv_prune.prune_heads(split, heads)
    sinv_prune.prune_heads(reference, heads)
    assert {name: p.device for name, p in split.named_parameters()} == before
    inputs = model_inputs()
    got = model_output(split, {k: v.to("cuda:0") for k, v in inputs.items()}).cpu()
    torch.testing.assert_close(got, model_output(reference, inputs), atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cpu_offload_next_to_a_gpu_prunes_in_place_and_a_run_refuses_it(pretrained):
    offload = {**SPLIT, "model.layers.1": "cpu", "model.norm": "cpu", "lm_head": "cpu"}  # accelerate: meta + hooks
    model = sinv_prune.from_pretrained(pretrained, device_map=offload)
    reference = sinv_prune.from_pretrained(pretrained)
    reason = unloadable_reason(model)  # a recipe run scores and fine-tunes, which read the weights in place
    assert reason is not None and "offloads weights" in reason
    sinv_prune.prune_heads(model, {1: [0, 2]})  # surgery brings the offloaded block in and writes it back
    sinv_prune.prune_heads(reference, {1: [0, 2]})
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    inputs = model_inputs()
    got = model_output(model, {k: v.to("cuda:0") for k, v in inputs.items()}).cpu()
    torch.testing.assert_close(got, model_output(reference, inputs), atol=1e-4, rtol=1e-4)


def test_attn_implementation_is_checked_through_public_apis():
    """The check builds the model on the meta device with the implementation; no private transformers method."""
    from sinv_prune.pipeline import model_settings

    model = build_model(validate_recipe(TINY), vocab_size=50)
    source = inspect.getsource(model_settings)
    assert "_check_and_adjust_attn_implementation" not in source
    model_settings.check_attn_implementation(model, "sdpa")
    model_settings.check_attn_implementation(model, "eager")
    with pytest.raises(RecipeError, match='model.attn_implementation: .*"fast"'):
        model_settings.check_attn_implementation(model, "fast")
    assert model.config._attn_implementation != "fast"  # the model's own config is untouched


def test_lora_wrapping_is_quiet_and_checkpointed_blocks_still_train():
    """peft's read of the deprecated ``is_gradient_checkpointing`` warns no user; with non-reentrant
    activation checkpointing enabled afterwards (as the Trainer does) the LoRA weights get gradients."""
    from sinv_prune.pipeline.model_settings import wrap_lora
    from sinv_prune.pipeline.recipe import LoraSpec

    model = tiny_model("llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrapped = wrap_lora(model, LoraSpec(r=2, alpha=4))
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]
    wrapped.train()
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    ids = torch.randint(0, 64, (2, 8))
    wrapped(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in wrapped.named_parameters() if "lora_" in n]
    assert grads and all(g is not None and g.abs().sum() > 0 for g in grads[1::2])  # lora_B: nonzero from step 1
