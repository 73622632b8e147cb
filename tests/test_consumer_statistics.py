"""shrink's statistics, one block at a time, against a whole-model pass with plain hooks in float64."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_model
from test_experts import tiny_moe

from sinv_prune.arch import get_adapter
from sinv_prune.scoring.consumer_statistics import Statistics, _batches
from sinv_prune.scoring.criteria.routing import ReapCriterion
from sinv_prune.surgery.store import Store


def _sequences(vocab: int, n: int = 7, length: int = 10) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return list(torch.randint(2, vocab, (n, length), generator=g))


def _reference(model, sequences, heldout):
    """Gram, cross, |Y|^2 and token counts of every consumer (fit / held-out), block influence: whole-model
    forwards with forward hooks, every product in float64; REAP scores from the criterion's own whole pass."""
    adapter = get_adapter(model)
    n = adapter.num_layers
    consumers = {("heads", i): adapter.out_proj(i) for i in range(n)}
    consumers |= {("mlp", i): adapter.mlp_out(i) for i in range(n) if not adapter.num_experts(i)}
    sums = {(key, part): None for key in consumers for part in (0, 1)}
    influence = [[0.0, 0] for _ in range(n)]
    state = {"held": 0}

    def consumer_hook(key, bias):
        def hook(module, args, output):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            y = output.reshape(-1, output.shape[-1]).double()
            if bias:
                x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=x.dtype)], 1)
            new = (x.T @ x, x.T @ y, y.square().sum(), x.shape[0])
            old = sums[key, state["held"]]
            sums[key, state["held"]] = new if old is None else tuple(a + b for a, b in zip(old, new, strict=True))

        return hook

    def block_hook(i):
        def hook(module, args, kwargs, output):
            x = args[0] if args else kwargs["hidden_states"]
            y = output[0] if isinstance(output, tuple) else output
            cos = torch.nn.functional.cosine_similarity(x.double(), y.double(), dim=-1)
            influence[i][0] += float((1 - cos).sum())
            influence[i][1] += cos.numel()

        return hook

    hooks = [m.register_forward_hook(consumer_hook(k, m.bias is not None)) for k, m in consumers.items()]
    hooks += [b.register_forward_hook(block_hook(i), with_kwargs=True) for i, b in enumerate(adapter.layers())]
    reap = ReapCriterion()
    fit_batches = []
    with torch.no_grad():
        for ids, held in _batches(sequences, heldout, 4):
            state["held"] = int(held)
            model(input_ids=ids, use_cache=False)
            if not held:
                fit_batches.append(ids)
    for h in hooks:
        h.remove()
    scores = [[] for _ in range(n)]
    if adapter.expert_counts():
        for ids in fit_batches:
            reap.update(model, {"input_ids": ids})
        scores = reap.scores(model)
    return sums, [s / c for s, c in influence], scores


@pytest.mark.parametrize(
    ("make", "where"),
    [
        (lambda: tiny_model("llama"), "cpu"),
        (lambda: tiny_moe("qwen3_moe"), "disk"),
        (lambda: tiny_model("gpt2"), "cpu"),
    ],
    ids=["llama", "qwen3_moe-disk", "gpt2-bias"],
)
def test_layerwise_statistics_equal_a_whole_model_pass(make, where):
    model = make()
    vocab = model.config.vocab_size
    seqs = _sequences(vocab)
    heldout = [i % 3 == 2 for i in range(len(seqs))]
    sums, influence, scores = _reference(model, seqs, heldout)
    seen = {}
    stats = Statistics(model, get_adapter(model), seqs, heldout, quiet=True, store=Store(where),
                       on_layer=lambda i, fits: seen.update(fits))  # fmt: skip
    assert set(stats.fits) == {key for key, _ in sums}
    for key in stats.fits:
        pair = stats.fits[key]
        for part, fit in enumerate(pair):
            gram, cross, target_sq, tokens = sums[key, part]
            assert fit.gram.dtype == torch.float64 and fit.tokens == tokens
            for got, ref in ((fit.gram, gram), (fit.cross, cross), (fit.target_sq, target_sq)):
                torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6 * float(ref.abs().max()))
            torch.testing.assert_close(seen[key][part].gram.double(), fit.gram, rtol=0, atol=0)  # what on_layer saw
    assert stats.influence == pytest.approx(influence, rel=1e-9, abs=1e-12)
    assert len(stats.expert_scores) == len(scores)
    for got, ref in zip(stats.expert_scores, scores, strict=True):
        assert got == pytest.approx(ref, rel=1e-5, abs=1e-9)
    if where == "disk":
        assert any(len(row) for row in stats.expert_scores)
        directory = stats.store.directory
        assert directory.is_dir() and len(list(directory.iterdir())) == len(stats.fits)
        stats.close()
        assert not directory.exists()


def test_float64_statistics_keep_float64_sums():
    model = tiny_model("llama")
    seqs = _sequences(model.config.vocab_size, n=4)
    heldout = [False, False, False, True]
    sums, _, _ = _reference(model, seqs, heldout)
    stats = Statistics(model, get_adapter(model), seqs, heldout, quiet=True, dtype="float64")
    key = ("mlp", 1)
    assert stats.store.get("mlp.1")["fit.gram"].dtype == torch.float64
    torch.testing.assert_close(stats.fits[key][0].gram, sums[key, 0][0], rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="statistics_dtype 'float16'"):
        Statistics(model, get_adapter(model), seqs, heldout, quiet=True, dtype="float16")


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_store_round_trip(where, tmp_path):
    store = Store(where, directory=tmp_path if where == "disk" else None)
    a = torch.randn(3, 4, dtype=torch.float64)
    store.put("x", {"a": a, "n": torch.tensor(7)}, dtype=torch.float32)
    a.zero_()  # the store holds its own copy
    got = store.get("x", dtype=torch.float64)
    assert got["a"].dtype == torch.float64 and got["n"].dtype == torch.int64 and int(got["n"]) == 7
    assert got["a"].abs().sum() > 0 and store.nbytes == 3 * 4 * 4 + 8 and "x" in store
    store.put("x", {"a": torch.ones(2)})
    assert torch.equal(store.get("x")["a"], torch.ones(2)) and len(store) == 1
    store.drop("x")
    assert "x" not in store and store.nbytes == 0
    with pytest.raises(KeyError, match="nothing under 'x'"):
        store.get("x")
    store.close()
    if where == "disk":
        assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="closed"):
        store.put("y", {"a": a})
    with pytest.raises(ValueError, match="where='gpu'"):
        Store("gpu")
