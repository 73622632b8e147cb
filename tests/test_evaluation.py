"""Perplexity, masked-LM loss, parameter breakdown and speed (sinv_prune.pipeline.evaluation)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ARCHS, VOCAB, tiny_model

import sinv_prune
from sinv_prune.arch import get_adapter
from sinv_prune.pipeline import evaluation


def stream(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed))


def hand_rolled_nll(model, ids: torch.Tensor, seq_len: int, stride: int) -> tuple[float, int]:
    """The Hugging Face guide's loop, one window at a time, through the model's own loss."""
    total, count, prev_end = 0.0, 0, 0
    for begin in range(0, len(ids), stride):
        end = min(begin + seq_len, len(ids))
        target_len = end - prev_end
        window = ids[None, begin:end]
        labels = window.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = model(input_ids=window, labels=labels).loss
        scored = int((labels[:, 1:] != -100).sum())  # the model shifts labels by one
        total += loss.item() * scored
        count += scored
        prev_end = end
        if end == len(ids):
            break
    return total / count, count


# -- perplexity --------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_perplexity_of_one_window_is_the_model_loss(arch):
    model = tiny_model(arch)
    ids = stream(50)
    with torch.no_grad():
        loss = model(input_ids=ids[None], labels=ids[None]).loss.item()
    for seq_len in (50, 64):
        result = evaluation.perplexity(model, ids, seq_len=seq_len, stride=7, progress=False)
        assert result["tokens"] == 49 and result["windows"] == 1
        assert result["nll"] == pytest.approx(loss, rel=1e-5)
        assert result["perplexity"] == pytest.approx(math.exp(loss), rel=1e-5)
        assert result["method"] == evaluation.PERPLEXITY_METHOD and result["seq_len"] == seq_len


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize(("seq_len", "stride", "batch_size"), [(32, 8, 3), (32, 13, 8), (20, 20, 2), (64, 31, 1)])
def test_strided_perplexity_equals_the_hand_rolled_loop(arch, seq_len, stride, batch_size):
    model = tiny_model(arch)
    ids = stream(157, seed=1)
    result = evaluation.perplexity(model, ids, seq_len=seq_len, stride=stride, batch_size=batch_size, progress=False)
    nll, count = hand_rolled_nll(model, ids, seq_len, stride)
    assert result["tokens"] == count
    assert result["nll"] == pytest.approx(nll, rel=1e-5)
    if stride < seq_len:
        assert count == len(ids) - 1  # every token but the first, exactly once


def test_perplexity_windows_score_every_token_once():
    for n in (2, 5, 17, 40):
        for seq_len in (2, 3, 8, 16, 50):
            for stride in range(1, seq_len + 1):
                windows = evaluation.perplexity_windows(n, seq_len, stride)
                scored = [t for _, end, first in windows for t in range(first, end)]
                assert all(end - begin <= seq_len and begin < first for begin, end, first in windows)
                assert windows[-1][1] == n
                if stride < seq_len:
                    assert scored == list(range(1, n))
                else:
                    assert scored == [t for t in range(n) if t % seq_len]


def test_perplexity_options_and_errors():
    model = tiny_model("gpt2")
    ids = stream(120, seed=2)
    full = evaluation.perplexity(model, ids[:90], seq_len=32, stride=16, progress=False)
    capped = evaluation.perplexity(model, ids, seq_len=32, stride=16, max_tokens=90, progress=False)
    assert capped == full
    assert evaluation.perplexity(model, ids[None], seq_len=32, progress=False)["stride"] == 32
    with pytest.raises(ValueError, match="positions"):
        evaluation.perplexity(model, ids, seq_len=65, stride=16, progress=False)  # n_positions=64
    with pytest.raises(ValueError, match="stride"):
        evaluation.perplexity(model, ids, seq_len=32, stride=33, progress=False)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        evaluation.perplexity(model, ids[:1], seq_len=32, progress=False)


def test_perplexity_is_in_eval_mode_and_restores_the_mode():
    model = tiny_model("gpt2").train()  # dropout on: only eval mode is deterministic
    ids = stream(100, seed=3)
    first = evaluation.perplexity(model, ids, seq_len=32, stride=16, progress=False)
    assert model.training
    assert evaluation.perplexity(model, ids, seq_len=32, stride=16, progress=False) == first
    model.eval()
    assert evaluation.perplexity(model, ids, seq_len=32, stride=16, progress=False) == first
    assert not model.training


@pytest.mark.parametrize(("arch", "heads"), [("gpt2", {0: [1], 2: [0, 3]}), ("llama", {0: [1, 4], 2: [3, 4, 5]})])
def test_perplexity_of_a_pruned_model_equals_the_masked_reference(arch, heads):
    model = tiny_model(arch)
    ids = stream(100, seed=4)
    with sinv_prune.head_gates(model, requires_grad=False) as gates:
        for layer, removed in heads.items():
            gates[layer][removed] = 0.0
        masked = evaluation.perplexity(model, ids, seq_len=40, stride=15, progress=False)
    pruned = copy.deepcopy(model)
    sinv_prune.prune_heads(pruned, heads)
    result = evaluation.perplexity(pruned, ids, seq_len=40, stride=15, progress=False)
    assert result["tokens"] == masked["tokens"]
    assert result["nll"] == pytest.approx(masked["nll"], rel=1e-7)
    intact = evaluation.perplexity(model, ids, seq_len=40, stride=15, progress=False)
    assert abs(intact["nll"] - result["nll"]) > 1e-5  # the heads mattered


# -- masked-LM loss ----------------------------------------------------------------------------


MASK_ID, CLS_ID, SEP_ID = 2, 1, 0


def test_mlm_loss_is_deterministic_and_equals_a_direct_computation():
    model = tiny_model("bert")
    ids = stream(60, seed=5)
    kwargs = dict(seq_len=64, mask_token_id=MASK_ID, mask_prob=0.3, seed=7, progress=False)
    result = evaluation.mlm_loss(model, ids, **kwargs)
    assert evaluation.mlm_loss(model, ids, **kwargs) == result
    corrupted, selected = evaluation.mlm_mask(ids, mask_token_id=MASK_ID, vocab_size=VOCAB, mask_prob=0.3, seed=7)
    assert torch.equal(corrupted[selected], torch.full((int(selected.sum()),), MASK_ID))
    assert torch.equal(corrupted[~selected], ids[~selected])
    with torch.no_grad():
        logits = model(input_ids=corrupted[None]).logits[0]
    direct = F.cross_entropy(logits[selected], ids[selected]).item()
    assert result["tokens"] == int(selected.sum()) > 0
    assert result["mlm_loss"] == pytest.approx(direct, rel=1e-5)
    assert result["mlm_perplexity"] == pytest.approx(math.exp(direct), rel=1e-5)
    assert result["strategy"] == "mask" and result["method"] == evaluation.MLM_METHOD


def test_mlm_loss_blocks_batches_and_special_tokens():
    model = tiny_model("bert").train()
    ids = stream(250, seed=6)
    ids[::10] = SEP_ID  # line separators: never masked
    kwargs = dict(mask_token_id=MASK_ID, special_ids=[SEP_ID], cls_id=CLS_ID, sep_id=SEP_ID, progress=False)
    one = evaluation.mlm_loss(model, ids, seq_len=32, batch_size=1, **kwargs)
    many = evaluation.mlm_loss(model, ids, seq_len=32, batch_size=16, **kwargs)
    assert model.training
    assert many["mlm_loss"] == pytest.approx(one["mlm_loss"], rel=1e-6) and many["tokens"] == one["tokens"]
    # by hand: blocks of [CLS] + 30 tokens + [SEP], the last one shorter
    corrupted, selected = evaluation.mlm_mask(
        ids, mask_token_id=MASK_ID, vocab_size=VOCAB, special_ids=[SEP_ID, CLS_ID]
    )
    assert not selected[ids == SEP_ID].any()
    total, count = 0.0, 0
    model.eval()
    for start in range(0, len(ids), 30):
        block = torch.cat([torch.tensor([CLS_ID]), corrupted[start : start + 30], torch.tensor([SEP_ID])])
        where = selected[start : start + 30]
        with torch.no_grad():
            logits = model(input_ids=block[None]).logits[0, 1:-1]
        total += F.cross_entropy(logits[where], ids[start : start + 30][where], reduction="sum").item()
        count += int(where.sum())
    assert one["tokens"] == count and one["mlm_loss"] == pytest.approx(total / count, rel=1e-5)


def test_mlm_mask_strategies_share_positions():
    ids = stream(4000, seed=8)
    masked, where = evaluation.mlm_mask(ids, mask_token_id=MASK_ID, vocab_size=VOCAB, special_ids=[5])
    bert, where_bert = evaluation.mlm_mask(
        ids, mask_token_id=MASK_ID, vocab_size=VOCAB, special_ids=[5], strategy="bert"
    )
    other, where_other = evaluation.mlm_mask(ids, mask_token_id=MASK_ID, vocab_size=VOCAB, special_ids=[5], seed=1)
    assert torch.equal(where, where_bert) and not torch.equal(where, where_other)
    assert not where[ids == 5].any() and 0.12 < where.float().mean() < 0.18
    as_mask = (bert[where] == MASK_ID).float().mean()
    unchanged = (bert[where] == ids[where]).float().mean()
    assert 0.75 < as_mask < 0.85 and 0.07 < unchanged < 0.15
    assert not (bert[where] == 5).any() and torch.equal(bert[~where], ids[~where])
    with pytest.raises(ValueError, match="strategy"):
        evaluation.mlm_mask(ids, mask_token_id=MASK_ID, vocab_size=VOCAB, strategy="whole-word")


# -- parameters --------------------------------------------------------------------------------


def test_parameter_breakdown_sums_and_tracks_pruning(arch):
    model = tiny_model(arch)
    adapter = get_adapter(model)
    before = evaluation.parameter_breakdown(model)
    assert before["total"] == sinv_prune.count_parameters(model)
    assert before["attention"] + before["embedding"] + before["other"] == before["total"]
    assert min(before.values()) > 0
    expected_attention = 0
    for layer in range(adapter.num_layers):
        proj = adapter.projections(layer)
        expected_attention += sum(t.numel() for t in vars(proj).values() if t is not None)
    assert before["attention"] == expected_attention
    layout = adapter.layout(1)
    summary = sinv_prune.prune_heads(model, {1: list(range(layout.group_size))})  # one KV group's heads
    after = evaluation.parameter_breakdown(model)
    removed = summary.params_before - summary.params_after
    assert removed > 0 and before["attention"] - after["attention"] == removed
    assert after["embedding"] == before["embedding"] and after["other"] == before["other"]


def test_parameter_breakdown_embedding_categories():
    gpt2 = tiny_model("gpt2")  # tied LM head; token and position embeddings
    assert evaluation.parameter_breakdown(gpt2)["embedding"] == (VOCAB + 64) * 32
    llama = tiny_model("llama")  # untied LM head, rotary positions
    assert evaluation.parameter_breakdown(llama)["embedding"] == 2 * VOCAB * 48


# -- speed -------------------------------------------------------------------------------------


SPEED_KEYS = {"latency_ms", "latency_ms_iqr", "tokens_per_s", "batch_size", "seq_len", "device", "threads"}


@pytest.mark.parametrize("arch", ["gpt2", "bert"])
def test_measure_speed_reports(arch):
    model = tiny_model(arch).train()
    result = evaluation.measure_speed(model, batch_size=2, seq_len=16, repeats=3, warmup=1)
    assert set(result) >= SPEED_KEYS and model.training
    assert result["latency_ms"] > 0 and result["latency_ms_iqr"] >= 0 and result["tokens_per_s"] > 0
    assert (result["batch_size"], result["seq_len"], result["device"], result["threads"]) == (2, 16, "cpu", 1)
    with pytest.raises(ValueError, match="repeats"):
        evaluation.measure_speed(model, repeats=0)


def test_compare_speed_reports_both_and_the_ratio():
    model = tiny_model("llama")
    pruned = copy.deepcopy(model)
    sinv_prune.prune_heads(pruned, {layer: [0, 1, 2] for layer in range(3)})
    result = evaluation.compare_speed(model, pruned, batch_size=1, seq_len=8, repeats=4, warmup=1)
    assert set(result["a"]) >= SPEED_KEYS and set(result["b"]) >= SPEED_KEYS
    assert result["latency_ratio"] > 0 and result["speedup"] == pytest.approx(1 / result["latency_ratio"])
    assert result["a"]["repeats"] == result["b"]["repeats"] == 4


@pytest.mark.parametrize("arch", ARCHS)
def test_measure_speed_runs_every_architecture(arch):
    result = evaluation.measure_speed(tiny_model(arch), batch_size=1, seq_len=8, repeats=1, warmup=0)
    assert result["latency_ms"] > 0 and result["latency_ms_iqr"] == 0


def scripted_timer(monkeypatch, latency: dict, noise: list[float]):
    """Replace the forward timer: model -> base latency, times a repeating noise factor; logs the calls."""
    calls = []

    def fake_timed(model, inputs, device):
        calls.append(model)
        return latency[id(model)] * noise[(len(calls) - 1) % len(noise)]

    monkeypatch.setattr(evaluation, "_timed", fake_timed)
    return calls


def test_compare_speed_interleaves_an_a_a_control(monkeypatch):
    a, b = tiny_model("gpt2"), tiny_model("gpt2")
    calls = scripted_timer(monkeypatch, {id(a): 1.0, id(b): 1.0}, [1.0])
    result = evaluation.compare_speed(a, b, seq_len=8, repeats=6, warmup=1, control=True)
    names = ["a" if m is a else "b" for m in calls]
    # warm-up a, b, a'; then rotations a b a' | b a' a | a' a b (a' is a timed again)
    assert "".join(names) == "aba" + "aba" + "baa" + "aab" + "aba" + "baa" + "aab"
    assert result["control"]["speedup"] == result["speedup"] == 1.0
    assert result["speedup_iqr"] == result["speedup_range"] == [1.0, 1.0]


def test_compare_speed_without_control_keeps_the_pairs(monkeypatch):
    a, b = tiny_model("gpt2"), tiny_model("gpt2")
    calls = scripted_timer(monkeypatch, {id(a): 1.0, id(b): 1.0}, [1.0])
    result = evaluation.compare_speed(a, b, seq_len=8, repeats=4, warmup=0)
    assert "".join("a" if m is a else "b" for m in calls) == "abbaabba"
    assert "control" not in result and "resolved" not in result


def test_a_speed_up_within_the_noise_is_not_resolved(monkeypatch):
    a, b = tiny_model("gpt2"), tiny_model("gpt2")
    noise = [1.00, 1.06, 0.95, 1.03, 0.97, 1.08, 0.93]  # +-8% per forward, like a shared CPU
    scripted_timer(monkeypatch, {id(a): 1.0, id(b): 1 / 1.03}, noise)  # b 3% faster
    result = evaluation.compare_speed(a, b, seq_len=8, repeats=12, warmup=0, control=True)
    lo, hi = result["control"]["speedup_iqr"]
    assert lo < 1 < hi  # the A/A control shows the noise
    assert result["speedup_range"][0] <= result["speedup_iqr"][0] <= result["speedup"] <= result["speedup_iqr"][1]
    assert result["resolved"] is False


def test_a_speed_up_beyond_the_noise_is_resolved(monkeypatch):
    a, b = tiny_model("gpt2"), tiny_model("gpt2")
    noise = [1.00, 1.02, 0.99, 1.01, 0.98]
    scripted_timer(monkeypatch, {id(a): 1.0, id(b): 1 / 1.5}, noise)  # b 1.5x faster
    result = evaluation.compare_speed(a, b, seq_len=8, repeats=12, warmup=0, control=True)
    assert result["speedup"] == pytest.approx(1.5, rel=0.06) and result["resolved"] is True
    slow = evaluation.compare_speed(b, a, seq_len=8, repeats=12, warmup=0, control=True)
    assert slow["speedup"] < 1 and slow["resolved"] is True


def test_speedup_resolved_needs_repeats_and_disjoint_ranges():
    assert evaluation.speedup_resolved([1.2, 1.3], [0.95, 1.05], repeats=10)
    assert evaluation.speedup_resolved([0.7, 0.8], [0.95, 1.05], repeats=10)
    assert not evaluation.speedup_resolved([1.02, 1.1], [0.95, 1.05], repeats=10)  # overlaps the control
    assert not evaluation.speedup_resolved([1.2, 1.3], [0.95, 1.05], repeats=evaluation.MIN_RESOLVED_REPEATS - 1)


def test_compare_speed_control_on_real_forwards():
    model = tiny_model("gpt2")
    result = evaluation.compare_speed(model, model, batch_size=1, seq_len=8, repeats=3, warmup=0, control=True)
    assert set(result["control"]) == {"speedup", "speedup_iqr", "speedup_range"}
    assert result["resolved"] is False  # three repetitions cannot resolve anything
    fields = evaluation.speedup_fields(result)
    assert fields["speedup_vs_baseline"] == result["speedup"] and fields["control"] == result["control"]
