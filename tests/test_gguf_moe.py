"""GGUF export of mixture-of-experts models: qwen3moe, qwen2moe, olmoe, Mixtral as llama; refusals; round trips."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

import sinv_prune
from sinv_prune.deploy import gguf_export
from sinv_prune.deploy.errors import ExportRefused, RoundTripFailed

VOCAB = 64
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "olmoe": "olmoe"}
FAMILIES = list(ARCH)
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=128, bos_token_id=0, eos_token_id=0, num_experts_per_tok=2)  # fmt: skip
CONFIGS = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(head_dim=16, moe_intermediate_size=32, num_experts=6, norm_topk_prob=True)),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=6)),
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=32, num_local_experts=6)),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM,
              dict(intermediate_size=32, num_experts=6, num_key_value_heads=4)),  # llama.cpp's olmoe: no GQA
}  # fmt: skip
UNIFORM = {"experts": {0: [1, 4], 1: [0, 5]}}  # 4 of 6 experts in both layers: stock config
PER_LAYER = {"experts": {0: [1], 1: [0, 5]}}  # 5 and 4: remote code


def tiny_moe(family: str, plan: dict | None = None, **overrides) -> transformers.PreTrainedModel:
    """A tiny random MoE model (norm weights and biases randomised too), float32, optionally pruned."""
    config_cls, model_cls, kwargs = CONFIGS[family]
    config = config_cls(**{**SHAPE, **kwargs, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    if plan:
        sinv_prune.prune(model, plan)
    return model


def export(model, tmp_path, name="m.gguf", **kwargs):
    kwargs.setdefault("type", "f32")
    kwargs.setdefault("verify", False)
    kwargs.setdefault("vocab", False)
    return sinv_prune.export_gguf(model, None, tmp_path / name, **kwargs)


# -- writer (no llama.cpp needed) ----------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_are_split_into_llama_cpps_tensors_and_keys(tmp_path, family):
    model = tiny_moe(family, UNIFORM)
    out = export(model, tmp_path, type="q8_0")
    arch = ARCH[family]
    assert out.arch == arch
    reader = gguf.GGUFReader(out.path)
    meta = {k: f.contents() for k, f in reader.fields.items()}
    data = {t.name: t for t in reader.tensors}
    assert meta[f"{arch}.expert_count"] == 4 and meta[f"{arch}.expert_used_count"] == 2
    width_key = "expert_feed_forward_length" if family.startswith("qwen") else "feed_forward_length"
    assert meta[f"{arch}.{width_key}"] == 32
    if family == "qwen2_moe":
        assert meta["qwen2moe.expert_shared_feed_forward_length"] == 48
        assert data["blk.1.ffn_gate_inp_shexp.weight"].tensor_type == gguf.GGMLQuantizationType.F32
        assert list(data["blk.1.ffn_gate_inp_shexp.weight"].shape) == [64]
    router = data["blk.1.ffn_gate_inp.weight"]
    assert router.tensor_type == gguf.GGMLQuantizationType.F32  # routers are never rounded
    np.testing.assert_array_equal(np.array(router.data), model.model.layers[1].mlp.gate.weight.detach().numpy())
    for kind, shape in (("gate", [64, 32, 4]), ("up", [64, 32, 4]), ("down", [32, 64, 4])):
        t = data[f"blk.1.ffn_{kind}_exps.weight"]
        assert list(t.shape) == shape and t.tensor_type == gguf.GGMLQuantizationType.Q8_0  # ggml order {in, out, E}
    assert "sinv_prune.record" in meta and '"pruned_experts"' in meta["sinv_prune.record"]


def test_gate_rows_come_first_in_the_fused_experts(tmp_path):
    model = tiny_moe("qwen3_moe")
    data = {t.name: np.array(t.data) for t in gguf.GGUFReader(export(model, tmp_path).path).tensors}
    fused = model.model.layers[0].mlp.experts.gate_up_proj.detach().numpy()  # [E, 2I, H]
    np.testing.assert_array_equal(data["blk.0.ffn_gate_exps.weight"], fused[:, :32])
    np.testing.assert_array_equal(data["blk.0.ffn_up_exps.weight"], fused[:, 32:])
    np.testing.assert_array_equal(data["blk.0.ffn_down_exps.weight"],
                                  model.model.layers[0].mlp.experts.down_proj.detach().numpy())  # fmt: skip


REFUSALS = [
    ("qwen3_moe per-layer experts", lambda: tiny_moe("qwen3_moe", PER_LAYER), "one expert count per model"),
    ("qwen2_moe per-layer experts", lambda: tiny_moe("qwen2_moe", PER_LAYER), "one expert count per model"),
    ("mixtral per-layer experts", lambda: tiny_moe("mixtral", PER_LAYER), "one expert count per model"),
    ("olmoe per-layer experts", lambda: tiny_moe("olmoe", PER_LAYER), "one expert count per model"),
    ("qwen3_moe dense layer", lambda: tiny_moe("qwen3_moe", mlp_only_layers=[1]), r"layers \[1\] are dense"),
    ("qwen2_moe sparse step 2", lambda: tiny_moe("qwen2_moe", decoder_sparse_step=2), r"layers \[0\] are dense"),
    ("qwen3_moe norm_topk_prob off", lambda: tiny_moe("qwen3_moe", norm_topk_prob=False), "always renormalises"),
    ("qwen2_moe norm_topk_prob on", lambda: tiny_moe("qwen2_moe", norm_topk_prob=True), "never renormalises"),
    ("olmoe norm_topk_prob on", lambda: tiny_moe("olmoe", norm_topk_prob=True), "never renormalises"),
    ("qwen2_moe fewer heads", lambda: tiny_moe("qwen2_moe", {"heads": {0: [0, 2], 1: [0, 2]}}), "hidden_size"),
    ("qwen3_moe uneven heads", lambda: tiny_moe("qwen3_moe", {"heads": {0: [0, 2]}}), "different head counts"),
    ("mixtral uneven heads", lambda: tiny_moe("mixtral", {"heads": {0: [0, 2]}}), "different head counts"),
    ("olmoe grouped-query attention", lambda: tiny_moe("olmoe", num_key_value_heads=2), "as many KV heads"),
    ("olmoe clip_qkv", lambda: tiny_moe("olmoe", clip_qkv=8.0), "clip_qkv"),
]


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_refusals_are_one_line_come_before_any_weight_is_copied_and_leave_nothing(tmp_path, monkeypatch, case):
    _, build, words = case
    model = build()

    def no_copy(*args, **kwargs):
        raise AssertionError("the weights were copied before the refusal")

    monkeypatch.setattr(gguf_export, "collect_tensors", no_copy)
    with pytest.raises(ExportRefused, match=words) as err:
        export(model, tmp_path, verify=None)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


# -- llama.cpp round trips ----------------------------------------------------------------------------


@pytest.mark.parametrize("plan", [None, UNIFORM], ids=["unpruned", "uniform expert cut"])
@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_matches_transformers(tmp_path, family, plan):
    pytest.importorskip("llama_cpp")
    model = tiny_moe(family, plan)
    out = export(model, tmp_path, verify=True)
    assert out.arch == ARCH[family]
    v = out.verify
    assert v.passed and v.exact_type and v.kv_cache == "f32" and v.top1_agreement == 1.0, v
    assert v.median_rel_diff < v.rtol and v.max_rel_diff < v.worst_rtol  # the dense LLaMA family's rule
    assert v.continuation_llama_cpp == v.continuation_transformers  # 16 greedy ids


ROUND_TRIP_EXTRAS = {
    "qwen3_moe uniform heads and experts": lambda: tiny_moe("qwen3_moe", {"heads": {0: [0, 2], 1: [1, 3]}, **UNIFORM}),
    "mixtral uniform heads and a removed layer": lambda: tiny_moe(
        "mixtral", {"heads": {i: [0, 2] for i in (1, 2)}, "layers": [0]}, num_hidden_layers=3
    ),
    **{
        f"{family} a removed layer and experts": lambda family=family: tiny_moe(
            family, {"layers": [1], "experts": {0: [2, 3], 2: [0, 1]}}, num_hidden_layers=3
        )
        for family in ("qwen3_moe", "qwen2_moe", "olmoe")
    },
    "qwen2_moe tied embeddings": lambda: tiny_moe("qwen2_moe", tie_word_embeddings=True),
    "olmoe tied embeddings": lambda: tiny_moe("olmoe", tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", list(ROUND_TRIP_EXTRAS))
def test_llama_cpp_matches_transformers_after_other_cuts(tmp_path, case):
    pytest.importorskip("llama_cpp")
    out = export(ROUND_TRIP_EXTRAS[case](), tmp_path, verify=True)
    assert out.verify.passed and out.verify.top1_agreement == 1.0, out.verify


@pytest.mark.parametrize("type_", ["f16", "q8_0", "q4_k_m"])
def test_rounded_moe_files_load_and_report_their_agreement(tmp_path, type_):
    pytest.importorskip("llama_cpp")
    out = export(tiny_moe("qwen2_moe", UNIFORM), tmp_path, type=type_, verify=True)
    assert out.arch == "qwen2moe" and not out.verify.exact_type and out.verify.passed  # reported, not judged
    assert 0.0 < out.verify.top1_agreement <= 1.0 and out.verify.tokens == 24
    router = next(t for t in gguf.GGUFReader(out.path).tensors if t.name == "blk.0.ffn_gate_inp.weight")
    assert router.tensor_type == gguf.GGMLQuantizationType.F32  # llama.cpp's quantiser keeps routers too


def _swap_two_experts(monkeypatch, name: str) -> None:
    """Write tensor ``name`` with experts 0 and 1 exchanged (what a wrong expert order would do)."""
    encode = gguf_export.encode

    def swapped(tensor, qtype):
        if tensor.name == name:
            order = np.arange(tensor.data.shape[0])
            order[[0, 1]] = [1, 0]
            tensor.data = np.ascontiguousarray(tensor.data[order])
        return encode(tensor, qtype)

    monkeypatch.setattr(gguf_export, "encode", swapped)


@pytest.mark.parametrize("family", FAMILIES)
def test_two_experts_swapped_in_one_tensor_fail_the_round_trip_and_leave_no_file(tmp_path, monkeypatch, family):
    pytest.importorskip("llama_cpp")
    _swap_two_experts(monkeypatch, "blk.1.ffn_down_exps.weight")
    with pytest.raises(RoundTripFailed, match=r"do not match transformers' .*; nothing was written") as err:
        export(tiny_moe(family, UNIFORM), tmp_path, verify=True)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_the_routing_refusal_is_needed(tmp_path, monkeypatch, family):
    """Written anyway, a model whose norm_topk_prob llama.cpp does not follow fails the round trip."""
    pytest.importorskip("llama_cpp")
    from sinv_prune.deploy.archs import native_arch

    arch = type(native_arch(family))
    other = not arch.renormalises  # what llama.cpp's graph does not do
    monkeypatch.setattr(arch, "renormalises", other)  # lifts the refusal, not llama.cpp's behaviour
    with pytest.raises(RoundTripFailed):
        export(tiny_moe(family, norm_topk_prob=other), tmp_path, verify=True)


# -- command line: saved checkpoints, reloaded -------------------------------------------------------


def test_cli_exports_a_saved_uniform_cut_and_refuses_a_per_layer_one(tmp_path):
    pytest.importorskip("llama_cpp")
    from click.testing import CliRunner

    from sinv_prune.cli import main

    tiny_moe("qwen3_moe", UNIFORM).save_pretrained(tmp_path / "uniform")  # stock config: num_experts 4
    tiny_moe("qwen3_moe", PER_LAYER).save_pretrained(tmp_path / "per-layer")  # remote code
    runner = CliRunner()
    out = tmp_path / "u.gguf"
    result = runner.invoke(main, ["export", str(tmp_path / "uniform"), str(out), "--type", "f32", "--no-vocab"])
    assert result.exit_code == 0, result.output
    assert "llama.cpp 'qwen3moe'" in result.output and "round trip passed" in result.output
    assert gguf.GGUFReader(out).fields["qwen3moe.expert_count"].contents() == 4
    refused = runner.invoke(main, ["export", str(tmp_path / "per-layer"), str(tmp_path / "p.gguf"), "--no-vocab"])
    assert refused.exit_code == 2, refused.output
    assert "one expert count per model" in refused.output.splitlines()[-1]
    assert not (tmp_path / "p.gguf").exists() and not list(tmp_path.glob(".p.gguf*"))
