"""shrink: the joint search over layers, heads and MLP channels (tiny random LLaMA with GQA)."""

from __future__ import annotations

import copy
import importlib
import json
import math

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
import transformers
from click.testing import CliRunner

import sinv_prune
from sinv_prune.cli import main
from sinv_prune.pipeline.data import train_tokenizer
from sinv_prune.scoring.allocation import non_embedding_parameters

VOCAB = 96


def tiny_llama(seed: int = 0, **overrides) -> transformers.LlamaForCausalLM:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    config = transformers.LlamaConfig(**{**settings, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def sequences(n: int = 16, length: int = 48, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(1, VOCAB, (n, length), generator=g))


def run(model, share=0.3, **kw):
    kw = {"calibration": sequences(), "budget": 12, "multiple": 8, "quiet": True, **kw}
    return sinv_prune.shrink(model, share, **kw)


def heldout_ppl(model, seqs, every: int = 8) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for i, ids in enumerate(seqs):
            if i % every == every - 1:
                logits = model(input_ids=ids[None]).logits[0, :-1].float()
                total += float(F.cross_entropy(logits, ids[1:], reduction="sum"))
                count += ids.numel() - 1
    return math.exp(total / count)


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_the_built_model_is_the_candidate_that_was_measured():
    model = tiny_llama()
    result = run(model)
    # the held-out perplexity was measured with masks and refits; the sliced model must give the same
    assert heldout_ppl(model, sequences()) == pytest.approx(result.heldout_ppl[result.chosen], rel=1e-4)
    assert result.params_before - result.params_after == result.removed
    assert result.statistics is None  # not kept unless asked (keep_statistics=True)


def test_target_met_within_one_mlp_step():
    model = tiny_llama()
    target = math.ceil(0.3 * non_embedding_parameters(model))
    result = run(model)
    assert result.target == target
    step = 8 * 3 * 48  # 8 channels x (gate, up rows + down column) of width 48
    # a searched plan overshoots by less than one step; a uniform seed by less than one step in every layer
    assert target <= result.removed < target + (step if result.chosen == "search" else 4 * step)
    assert sum(result.shares.values()) == result.removed


def test_never_worse_than_its_seeds_and_deterministic():
    a, b = tiny_llama(), tiny_llama()
    ra, rb = run(a, seed=3), run(b, seed=3)
    assert ra.plan == rb.plan and ra.fitness == rb.fitness
    assert ra.fitness <= min(s["fitness"] for s in ra.seeds.values())
    assert {"mlp", "heads+mlp", "layers+mlp"} <= set(ra.seeds)
    best_seed = min(ra.seeds, key=lambda n: ra.seeds[n]["fitness"])
    if best_seed in ra.heldout_ppl:
        assert ra.heldout_ppl[ra.chosen] <= ra.heldout_ppl[best_seed]
    torch.testing.assert_close(logits(a, sequences()[0][None]), logits(b, sequences()[0][None]))


def test_a_block_that_does_nothing_is_the_one_dropped():
    model = tiny_llama()
    with torch.no_grad():  # block 2 adds nothing to the residual stream
        model.model.layers[2].self_attn.o_proj.weight.zero_()
        model.model.layers[2].mlp.down_proj.weight.zero_()
    block = sum(p.numel() for p in model.model.layers[2].parameters())
    share = (block - 200) / non_embedding_parameters(model)
    reference = copy.deepcopy(model)
    result = run(model, share=share, units=("layers", "mlp"))
    assert result.plan.get("layers") == [2]
    assert result.fitness < 1e-6
    ids = sequences()[0][None]
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-4, rtol=1e-4)


def test_stock_plans_reload_on_the_stock_class(tmp_path):
    model = tiny_llama()
    result = run(model, share=0.4, stock=True)
    kept = [w for w in result.widths if not w.get("dropped")]
    assert len({(w["heads"], w["kv_heads"], w["mlp"]) for w in kept}) == 1
    assert result.record_stock is True
    model.save_pretrained(tmp_path)
    again = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    ids = sequences()[1][None]
    torch.testing.assert_close(logits(again, ids), logits(model, ids))


def test_uneven_plans_reload_through_sinv_prune(tmp_path):
    model = tiny_llama()
    run(model, share=0.35, budget=16, seed=1)
    model.save_pretrained(tmp_path)
    again = sinv_prune.from_pretrained(tmp_path)
    ids = sequences()[2][None]
    torch.testing.assert_close(logits(again, ids), logits(model, ids))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": 1.5}, "share between 0 and 1"),
        ({"params": 0.2, "to": 1000}, "exactly one of"),
        ({"params": 0.2, "units": ("layers", "heads")}, "must include 'mlp'"),
        ({"params": 0.99}, "no plan removes"),
        ({"params": None, "to": 10**9}, "the target must remove"),
        ({"params": 0.2, "statistics_dtype": "float16"}, "statistics_dtype 'float16'"),
    ],
)
def test_bad_requests_raise_one_line_and_change_nothing(kwargs, message):
    model = tiny_llama()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message) as err:
        sinv_prune.shrink(model, calibration=sequences(), quiet=True, **kwargs)
    assert "\n" not in str(err.value)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_cli_shrinks_from_text_and_refuses_bad_input(tmp_path, monkeypatch):
    lines = [" ".join(f"w{(i * 7 + j) % 80}" for j in range(30)) for i in range(400)]
    text = tmp_path / "calib.txt"
    text.write_text("\n".join(lines))
    tokenizer = train_tokenizer(lines, "word", vocab_size=VOCAB)
    source = tmp_path / "model"
    tiny_llama().save_pretrained(source)
    tokenizer.save_pretrained(source)
    out = tmp_path / "small"
    args = ["shrink", str(source), str(out), "--params", "0.3", "--calibration", str(text), "--sequences", "8",
            "--length", "32", "--budget", "6", "--statistics-dtype", "float64", "-q"]  # fmt: skip
    done = CliRunner().invoke(main, args)
    assert done.exit_code == 0, done.output
    assert "share of the cut" in done.output
    assert (out / "shrink.json").is_file() and (out / "tokenizer.json").is_file()
    assert json.loads((out / "shrink.json").read_text())["settings"]["statistics_dtype"] == "float64"
    assert sinv_prune.from_pretrained(out).num_parameters() < tiny_llama().num_parameters()
    again = CliRunner().invoke(main, args)
    assert again.exit_code == 2 and "--overwrite" in again.output
    bad = CliRunner().invoke(main, [*args[:3], "--to", "lots", *args[5:], "--overwrite"])
    assert bad.exit_code == 2 and "not a size" in bad.output
    short = CliRunner().invoke(main, [*args, "--overwrite", "--sequences", "4000"])
    assert short.exit_code == 2 and "fewer than" in short.output
    command = importlib.import_module("sinv_prune.shrink.command")
    monkeypatch.setattr(command, "shrink", lambda *a, **k: pytest.fail("searched, then refused"))
    gguf = CliRunner().invoke(main, [args[0], args[1], str(tmp_path / "gguf-out"), *args[3:], "--gguf", "f32"])
    assert gguf.exit_code == 2 and "tokenizer" in gguf.output  # a word-level vocabulary llama.cpp cannot read
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.txt", "model", "small"]


def test_refine_keeps_the_better_build_and_it_reloads(tmp_path):
    model = tiny_llama()
    result = run(model, share=0.35, refine=True, units=("layers", "heads", "mlp"))
    assert "sequential" in result.heldout_ppl
    kept = "sequential" if result.built == "sequential OBS refit" else result.chosen
    assert result.heldout_ppl[kept] == min(result.heldout_ppl["sequential"], result.heldout_ppl[result.chosen])
    assert heldout_ppl(model, sequences()) == pytest.approx(result.heldout_ppl[kept], rel=1e-4)
    assert result.params_before - result.params_after == result.removed
    model.save_pretrained(tmp_path)
    ids = sequences()[3][None]
    torch.testing.assert_close(logits(sinv_prune.from_pretrained(tmp_path), ids), logits(model, ids))


@pytest.mark.parametrize("stock", [True, False])
def test_shrunk_models_pass_the_llama_cpp_round_trip(tmp_path, stock):
    pytest.importorskip("llama_cpp")
    model = tiny_llama(num_hidden_layers=5)
    result = run(model, share=0.3, stock=stock, budget=10)
    out = sinv_prune.export_gguf(model, None, tmp_path / "m.gguf", type="f32", verify=True, vocab=False)
    assert out.verify.passed and out.verify.top1_agreement == 1.0, out.verify
    assert out.verify.max_rel_diff < out.verify.worst_rtol
    if stock:
        assert result.record_stock is True


def test_reused_statistics_give_the_same_cut_on_a_fresh_copy():
    first, second, third = tiny_llama(), tiny_llama(), tiny_llama()
    ra = run(first, seed=2, keep_statistics=True)
    rb = run(second, share=0.25, seed=2, statistics=ra.statistics)  # the pass of the (now pruned) first model
    rc = run(third, share=0.25, seed=2)
    assert rb.plan == rc.plan and rb.fitness == rc.fitness
    assert heldout_ppl(second, sequences()) == pytest.approx(rb.heldout_ppl[rb.chosen], rel=1e-4)
    with pytest.raises(ValueError, match="statistics of another model"):
        run(first, share=0.2, statistics=ra.statistics)  # first is pruned: its widths differ
