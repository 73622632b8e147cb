"""The host store and prune's use of it: the same weights whether the store is in memory or on disk."""

from __future__ import annotations

import pytest
import torch
from conftest import model_inputs, model_output, tiny_model
from test_compensation import calibration, state

import sinv_prune
from sinv_prune.surgery import compensation
from sinv_prune.surgery.store import Store

# Six layers: heads (whole KV groups and per group) and MLP channels in most of them.
PLAN = {
    "heads": {0: [0, 3], 1: [2, 3], 3: [1, 4], 5: [0, 1, 2]},
    "mlp": {0: list(range(0, 64, 4)), 2: list(range(10, 30)), 4: list(range(1, 64, 3)), 5: [5, 6, 7]},
}


def _llama6():
    return tiny_model("llama", num_hidden_layers=6)


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_store_gives_back_what_it_was_given(where, tmp_path):
    big = torch.arange(100_000, dtype=torch.float32).reshape(100, 1000)
    view = big[:, 3:5]  # a view of a larger storage
    with Store(where, directory=tmp_path) as store:
        store.put("a", {"w": view, "b": None})
        store.put(("b", 1), {"x": torch.ones(3, dtype=torch.float64)})
        assert "a" in store and len(store) == 2
        got = store.get("a", "cpu")
        assert torch.equal(got["w"], view) and got["b"] is None
        if where == "disk":  # the file holds the view's bytes, not its storage's
            assert sum(f.stat().st_size for f in tmp_path.rglob("*.safetensors")) < big.numel() * 4 // 10
        assert store.pop(("b", 1))["x"].dtype == torch.float64
        assert ("b", 1) not in store
        with pytest.raises(KeyError, match="the store holds nothing"):
            store.get(("b", 1))
    assert not list(tmp_path.rglob("*.safetensors"))  # closed: files gone


def test_store_refuses_an_unknown_place():
    with pytest.raises(ValueError, match="store where='gpu': expected one of cpu, disk"):
        Store("gpu")
    with pytest.raises(ValueError, match="store must be one of"):
        sinv_prune.prune(_llama6(), PLAN, store="ram")


def _untimed(summary: dict) -> dict:
    """A summary's dict without its times."""
    report = {k: v for k, v in summary["compensation"].items() if k not in ("seconds", "us_per_token")}
    report["layers"] = [{k: v for k, v in f.items() if k != "seconds"} for f in report["layers"]]
    return {**summary, "compensation": report}


def _spy(monkeypatch) -> list:
    """Record the keys every Store.put sees."""
    keys, put = [], Store.put

    def spying(self, key, tensors):
        keys.append((self.where, key))
        return put(self, key, tensors)

    monkeypatch.setattr(Store, "put", spying)
    return keys


@pytest.mark.parametrize("method", ["obs", "lsq"])
def test_prune_gives_the_same_weights_with_the_store_on_disk(method, monkeypatch):
    """The rollback and the undo of refits go through the store; where it keeps them changes nothing."""
    keys = _spy(monkeypatch)
    results = {}
    for where in ("cpu", "disk"):
        model = _llama6()
        summary = sinv_prune.prune(model, PLAN, calibration=calibration(8), compensate=method, store=where)
        results[where] = (state(model), summary.to_dict(), model_output(model, model_inputs(seed=3)))
    (cpu_state, cpu_summary, cpu_out), (disk_state, disk_summary, disk_out) = results["cpu"], results["disk"]
    assert cpu_state.keys() == disk_state.keys()
    assert all(torch.equal(cpu_state[k], disk_state[k]) for k in cpu_state)
    assert torch.equal(cpu_out, disk_out)
    assert _untimed(cpu_summary) == _untimed(disk_summary)
    # Both routes really used the store: old weights of every cut block, plain weights of refits.
    for where in ("cpu", "disk"):
        spilled = {key[0] for w, key in keys if w == where and key[1] == "parameter"}
        plain = [key for w, key in keys if w == where and key[0] == "plain"]
        assert spilled and (plain or cpu_summary["compensation"]["kept"] == "compensated")
        refits = sum(f["refit"] for f in cpu_summary["compensation"]["layers"])
        assert len(plain) == refits


def test_a_failure_in_the_last_block_restores_the_model_from_disk(monkeypatch):
    """Blocks already cut had their old weights written to disk; the rollback reads them back."""
    model = _llama6()
    saved, config, cls = state(model), model.config.to_dict(), type(model)
    expected = model_output(model, model_inputs(seed=4))
    keys = _spy(monkeypatch)
    fit = compensation._fit

    def failing(index, *args, **kwargs):
        if index == 5:
            raise RuntimeError("failed in the last block")
        return fit(index, *args, **kwargs)

    monkeypatch.setattr(compensation, "_fit", failing)
    with pytest.raises(RuntimeError, match="failed in the last block"):
        sinv_prune.prune(model, PLAN, calibration=calibration(8), compensate="obs", store="disk")
    assert any(key[1] == "parameter" for _, key in keys)  # something was spilled before the failure
    assert type(model) is cls and model.config.to_dict() == config
    now = model.state_dict()
    assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in now)
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
    assert torch.equal(model_output(model, model_inputs(seed=4)), expected)


def test_a_failure_without_compensation_restores_the_model_from_disk(monkeypatch):
    from sinv_prune.surgery import removal

    model = _llama6()
    saved = state(model)
    monkeypatch.setattr(removal, "set_record", lambda *a: (_ for _ in ()).throw(RuntimeError("injected failure")))
    with pytest.raises(RuntimeError, match="injected failure"):
        sinv_prune.prune(model, PLAN, store="disk")
    now = model.state_dict()
    assert now.keys() == saved.keys() and all(torch.equal(now[k], saved[k]) for k in now)


def test_plain_kept_from_a_disk_store_gives_the_plainly_pruned_weights(monkeypatch):
    from sinv_prune.surgery import heldout

    model, plain = _llama6(), _llama6()
    sinv_prune.prune(plain, PLAN)
    calls = []

    def rigged(self):  # unpruned, compensated, plain: the plain model looks better
        calls.append(1)
        return {1: 0.0, 2: 2.0, 3: 1.0}[len(calls)]

    monkeypatch.setattr(heldout.HeldOutLoss, "__call__", rigged)
    summary = sinv_prune.prune(model, PLAN, calibration=calibration(8), compensate="lsq", store="disk")
    assert summary.compensation.kept == "plain"
    assert any(f.refit for f in summary.compensation.layers)
    theirs = plain.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in model.state_dict().items())


def test_a_pruner_with_its_removal_on_disk_cuts_the_same_experts_and_weights():
    from test_experts import tiny_moe

    from sinv_prune.scoring.pruner import Part, Pruner

    batches = [model_inputs(seed=s) for s in range(2)]
    models, spilled = [], []
    for where in ("cpu", "disk"):
        model = tiny_moe("qwen3_moe")
        put = Store.put
        seen = []

        def spy(self, key, tensors, *a, _seen=seen, _put=put, **k):
            _seen.append(self.where)
            return _put(self, key, tensors, *a, **k)

        Store.put = spy
        try:
            pruner = Pruner([Part("experts", "reap", 0.34)], store=where)
            pruner.prune(model, batches=batches)
        finally:
            Store.put = put
        models.append((model, pruner.last_selection))
        spilled.append(set(seen))
    (a, sel_a), (b, sel_b) = models
    assert sel_a == sel_b and any(sel_a["experts"].values())
    assert spilled == [{"cpu"}, {"disk"}]  # the rollback copies went where asked
    assert a.state_dict().keys() == b.state_dict().keys()
    assert all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    with pytest.raises(ValueError, match="store must be one of"):
        Pruner([Part("experts", "reap", 0.34)], store="ram")
