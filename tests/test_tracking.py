"""Convergence tracking: the stopping rule, the Trainer callback, head freezing, log scalars."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from conftest import VOCAB, model_inputs, tiny_model

from sinv_prune.arch import get_adapter
from sinv_prune.pipeline.tracking import ConvergenceCallback, HeadFreezer, log_scalars, rule_max, stop_rule, track
from sinv_prune.scoring.trace import measurements, read_trace


def _record(c_q, c_v, c_ff, **extra):
    return {"step": 1, "epoch": None, "C_Q": c_q, "C_V": c_v, "C_FF": c_ff, **extra}


# -- the rule -----------------------------------------------------------------------------------


def test_stop_rule_fires_when_every_measure_is_below():
    record = _record([[0.01, 0.02], [0.04]], [[0.03, 0.0], [0.049]], [0.01, None], C_V_layer=[None, 0.9])
    assert stop_rule(record, 0.05)
    assert rule_max(record) == pytest.approx(0.049)
    # C_V_layer is high but not among the rule's measures by default; asking for it changes the verdict
    assert not stop_rule(record, 0.05, ("C_Q", "C_V", "C_FF", "C_V_layer"))


@pytest.mark.parametrize("which", ["C_Q", "C_V", "C_FF"])
def test_stop_rule_does_not_fire_when_one_measure_is_above(which):
    values = {"C_Q": [[0.01, 0.02], [0.04]], "C_V": [[0.03, 0.0], [0.01]], "C_FF": [0.01, 0.02]}
    if which == "C_FF":
        values["C_FF"] = [0.01, 0.06]
    else:
        values[which][1][0] = 0.06
    assert not stop_rule(_record(values["C_Q"], values["C_V"], values["C_FF"]), 0.05)
    assert stop_rule(_record(values["C_Q"], values["C_V"], values["C_FF"]), 0.07)


def test_stop_rule_edge_cases():
    assert not stop_rule(_record([[]], [[]], [None]))  # nothing to judge
    assert not stop_rule(_record([[0.01, float("nan")]], [[0.01]], [0.01]))  # NaN is not converged
    assert stop_rule(_record([[0.01]], [[0.01]], [0.01]), measures=("C_Q",))
    with pytest.raises(ValueError, match="lacks"):
        stop_rule({"step": 0, "C_Q": [[0.0]]}, measures=("C_Q", "C_Vv"))


def test_track_appends_measurement_lines(tmp_path):
    model = tiny_model("gpt2")
    path = tmp_path / "t.jsonl"
    rec = track(model, path, 3, 0.5, loss=2.0)
    track(model, path, 6, 1.0)
    lines = read_trace(path)
    assert [r["step"] for r in measurements(lines)] == [3, 6]
    assert lines[0]["loss"] == 2.0 and lines[0]["epoch"] == 0.5
    assert len(rec["C_Q"]) == 3 and len(rec["C_Q"][0]) == 4 and len(rec["C_FF"]) == 3


def test_log_scalars_names():
    rec = _record([[0.2, 0.4], [0.6]], [[0.1, 0.3], [0.5]], [0.7, 0.8])
    s = log_scalars(rec)
    assert s["sinv/C_Q_max"] == 0.6 and s["sinv/C_Q_mean"] == pytest.approx(0.4)
    assert s["sinv/rule_max"] == 0.8 and s["sinv/C_FF_max"] == 0.8
    assert s["sinv/layer_00/C_Q_mean"] == pytest.approx(0.3) and s["sinv/layer_01/C_Q_max"] == 0.6
    assert "sinv/layer_00/C_Q_mean" not in log_scalars(rec, per_layer=False)


# -- the Trainer callback -------------------------------------------------------------------------


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64, length=12, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(3, VOCAB, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _trainer(tmp_path, callback, *, model=None, max_steps=6, optim="adamw_torch", weight_decay=0.0, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, max_steps=max_steps, logging_steps=2,
        learning_rate=1e-2, weight_decay=weight_decay, optim=optim, report_to="none", use_cpu=True,
        save_strategy="no", disable_tqdm=True, seed=0, **kw,
    )  # fmt: skip
    model = (model or tiny_model("gpt2")).train()
    return transformers.Trainer(model=model, args=args, train_dataset=_Tokens(), callbacks=[callback])


def test_callback_writes_trace_and_not_fired_note(tmp_path):
    cb = ConvergenceCallback(tmp_path / "trace.jsonl", every_n_steps=2)
    trainer = _trainer(tmp_path, cb)
    trainer.train()
    lines = read_trace(tmp_path / "trace.jsonl")
    events = [r.get("event") for r in lines if "event" in r]
    meas = measurements(lines)
    # train_begin note, measurements at steps 0 (baseline), 2, 4, 6 (epoch end = step 6: not repeated), end note
    assert events == ["train_begin", "stop_rule_not_fired"]
    assert [r["step"] for r in meas] == [0, 2, 4, 6]
    assert [r["when"] for r in meas] == ["train_begin", "step", "step", "step"]
    assert len(lines) == 6
    assert meas[2]["loss_step"] == 2 and meas[2]["loss"] > 0  # latest logged loss at measuring time
    note = lines[-1]
    assert note["min_max_measure"] == pytest.approx(min(rule_max(r) for r in meas[1:]))
    assert note["min_max_step"] in (2, 4, 6) and note["threshold"] == 0.05
    assert set(note["final_max"]) == {"C_Q", "C_V", "C_FF"}
    assert trainer.state.global_step == 6 and cb.fired_at is None
    # the measure scalars reached the Trainer's logs (log_history gets them at the logging steps)
    logged = [h for h in trainer.state.log_history if "sinv/C_Q_max" in h]
    assert [h["step"] for h in logged] == [2, 4, 6]
    assert logged[0]["sinv/C_Q_max"] == pytest.approx(log_scalars(meas[1])["sinv/C_Q_max"])
    assert "sinv/layer_02/C_Q_mean" in logged[0] and "loss" in logged[0]


def test_attach_puts_scalars_in_front_of_reporting_callbacks(tmp_path):
    seen = []

    class Reporter(transformers.TrainerCallback):  # stands in for TensorBoard / W&B, created first
        def on_log(self, args, state, control, logs=None, **kwargs):
            seen.append(dict(logs))

    cb = ConvergenceCallback(tmp_path / "trace.jsonl", every_n_steps=2)
    trainer = _trainer(tmp_path, Reporter(), max_steps=2)
    cb.attach(trainer)
    trainer.train()
    assert any("sinv/C_Q_max" in logs and "loss" in logs for logs in seen)


def test_callback_stops_training_when_rule_fires(tmp_path, caplog):
    cb = ConvergenceCallback(tmp_path / "trace.jsonl", every_n_steps=2, threshold=1.0, stop=True)
    trainer = _trainer(tmp_path, cb, max_steps=20)
    with caplog.at_level(logging.WARNING, logger="sinv_prune.pipeline.tracking"):
        trainer.train()
    assert trainer.state.global_step == 2 and cb.fired_at == 2
    lines = read_trace(tmp_path / "trace.jsonl")
    fired = [r for r in lines if r.get("event") == "stop_rule_fired"]
    assert len(fired) == 1 and fired[0]["step"] == 2 and fired[0]["stopped"] is True
    assert not any(r.get("event") == "stop_rule_not_fired" for r in lines)
    assert "stopping rule fired at step 2" in caplog.text


def test_callback_rule_without_stop_keeps_training(tmp_path):
    cb = ConvergenceCallback(tmp_path / "trace.jsonl", every_n_steps=2, threshold=1.0, stop=False)
    trainer = _trainer(tmp_path, cb, max_steps=4)
    trainer.train()
    assert trainer.state.global_step == 4 and cb.fired_at == 2
    fired = [r for r in read_trace(tmp_path / "trace.jsonl") if r.get("event") == "stop_rule_fired"]
    assert len(fired) == 1 and fired[0]["stopped"] is False


def test_callback_default_trace_path_and_epoch_end(tmp_path):
    cb = ConvergenceCallback(every_n_steps=0, on_train_begin=False)
    trainer = _trainer(tmp_path, cb, max_steps=-1, num_train_epochs=2)  # 64 samples / 8 = 8 steps per epoch
    trainer.train()
    meas = measurements(read_trace(tmp_path / "out" / "sinv_trace.jsonl"))
    assert [(r["step"], r["when"]) for r in meas] == [(8, "epoch_end"), (16, "epoch_end")]
    assert meas[-1]["epoch"] == pytest.approx(2.0)


# -- freezing -----------------------------------------------------------------------------------


def _slices(model, layer):
    p = get_adapter(model).projections(layer)
    return {
        k: None if getattr(p, k) is None else getattr(p, k).detach().clone()
        for k in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias")
    }


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_head_freezer_keeps_frozen_slices_under_adamw(arch):
    """AdamW with weight decay: zero grads alone would still move the weights; restore pins them."""
    model = tiny_model(arch).train()
    layout = get_adapter(model).layout(1)
    d, group = layout.head_dim, layout.group_size
    frozen = list(range(group)) + [group + 1]  # all of KV head 0's group, one head of KV head 1
    freezer = HeadFreezer(model)
    freezer.freeze(1, frozen)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    freezer.attach_optimizer(opt)
    before = _slices(model, 1)
    grads = {}
    for i in range(3):
        inputs = model_inputs(seed=i)
        model(**inputs, labels=inputs["input_ids"]).loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
    after = _slices(model, 1)

    def rows(t, heads):
        return torch.cat([t[h * d : (h + 1) * d] for h in heads])

    free_q = [h for h in range(layout.num_heads) if h not in frozen]
    for key in ("q", "q_bias"):
        if before[key] is None:
            continue
        assert torch.equal(rows(before[key], frozen), rows(after[key], frozen))
        assert not torch.allclose(rows(before[key], free_q), rows(after[key], free_q))
    assert torch.equal(rows(before["o"].T, frozen), rows(after["o"].T, frozen))
    assert not torch.allclose(rows(before["o"].T, free_q), rows(after["o"].T, free_q))
    for key in ("k", "v"):  # KV head 0 frozen (whole group), KV head 1 not (one of its heads is free)
        assert torch.equal(before[key][:d], after[key][:d])
        assert not torch.allclose(before[key][d : 2 * d], after[key][d : 2 * d])
    # the gradient hook zeroed the frozen rows of the last gradient
    name = "transformer.h.1.attn.c_attn.weight" if arch == "gpt2" else "model.layers.1.self_attn.q_proj.weight"
    g = grads[name]
    q_grad = g.T[: layout.num_heads * d] if arch == "gpt2" else g
    assert rows(q_grad, frozen).abs().sum() == 0 and rows(q_grad, free_q).abs().sum() > 0
    freezer.remove()
    assert freezer.frozen_heads() == [[], [], []]


def test_callback_freezes_converged_heads(tmp_path):
    """threshold 1.0 marks every head converged at the baseline; plain SGD, no decay: nothing in
    Q/K/V/O moves, while the MLP keeps training."""
    model = tiny_model("gpt2")
    adapter = get_adapter(model)
    before = [_slices(model, layer) for layer in range(3)]
    mlp_before = adapter.mlp(0)[0].detach().clone()
    cb = ConvergenceCallback(tmp_path / "trace.jsonl", every_n_steps=2, freeze_converged=True, freeze_threshold=1.0)
    trainer = _trainer(tmp_path, cb, model=model, max_steps=4, optim="sgd")
    trainer.train()
    for layer in range(3):
        after = _slices(model, layer)
        for key in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias"):
            assert torch.equal(before[layer][key], after[key]), (layer, key)
    assert not torch.allclose(mlp_before, adapter.mlp(0)[0])
    lines = read_trace(tmp_path / "trace.jsonl")
    frozen_notes = [r for r in lines if r.get("event") == "heads_frozen"]
    assert len(frozen_notes) == 1 and frozen_notes[0]["step"] == 0
    assert frozen_notes[0]["heads"] == {"0": [0, 1, 2, 3], "1": [0, 1, 2, 3], "2": [0, 1, 2, 3]}
    assert measurements(lines)[-1]["frozen"] == [[0, 1, 2, 3]] * 3
    # hooks are gone after training
    assert cb.freezer.frozen_heads() == [[], [], []]


def test_callback_freezes_selected_heads_only(tmp_path):
    """Freeze by a threshold between head values: frozen heads stay put, the others move (AdamW + decay)."""
    model = tiny_model("gpt2")
    c_q = track(model, None, 0)["C_Q"]
    cut = sorted(v for layer in c_q for v in layer)[6]  # 6 heads below
    frozen = [[h for h, v in enumerate(layer) if v < cut] for layer in c_q]
    before = [_slices(model, layer) for layer in range(3)]
    cb = ConvergenceCallback(tmp_path / "trace.jsonl", every_n_steps=100, freeze_converged=True, freeze_threshold=cut)
    _trainer(tmp_path, cb, model=model, max_steps=3, weight_decay=0.1).train()
    d = get_adapter(model).layout(0).head_dim
    moved = 0
    for layer in range(3):
        after = _slices(model, layer)
        for h in range(4):
            same = torch.equal(before[layer]["q"][h * d : (h + 1) * d], after["q"][h * d : (h + 1) * d])
            assert same == (h in frozen[layer]), (layer, h)
            moved += not same
    assert moved == 12 - 6
