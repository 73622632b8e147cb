"""shrink's fitness: a candidate's forward starts at its first changed block and gives a full forward's KL."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch
from test_experts import tiny_moe
from test_shrink import sequences, tiny_llama

from sinv_prune.arch import get_adapter
from sinv_prune.scoring.allocation import non_embedding_parameters
from sinv_prune.scoring.consumer_statistics import Statistics
from sinv_prune.shrink.fitness import Candidates
from sinv_prune.shrink.search import model_units, seed_genomes
from sinv_prune.shrink.space import build_space
from sinv_prune.shrink.statistics import Picks
from sinv_prune.surgery.store import Store


def _full_kl(model, reference: list[torch.Tensor], batches: list[torch.Tensor]) -> float:
    """KL(unpruned || model as it is now) per token, from plain whole-model forwards."""
    total, count = 0.0, 0
    with torch.no_grad():
        for ref, ids in zip(reference, batches, strict=True):
            logp = torch.log_softmax(model(input_ids=ids, use_cache=False).logits.float(), -1)
            kl = (ref.exp() * (ref - logp)).sum(-1)
            total, count = total + float(kl.sum()), count + kl.numel()
    return total / count


@pytest.mark.parametrize("where", ["cpu", "disk"])
@pytest.mark.parametrize("make", [tiny_llama, lambda: tiny_moe("qwen3_moe")], ids=["llama", "qwen3_moe"])
def test_reused_block_outputs_give_the_full_forwards_kl(make, where):
    """Kept block outputs and refits in host memory or on disk (the picks then hold none in memory)."""
    model = make()
    adapter = get_adapter(model)
    seqs = [s % model.config.vocab_size for s in sequences()]
    heldout = [i % 4 == 3 for i in range(len(seqs))]
    target = math.ceil(0.3 * non_embedding_parameters(model))
    space = build_space(model, adapter, target, stock=False, units=model_units(adapter), multiple=4, min_mlp=0.25)
    stats = Statistics(model, adapter, seqs, heldout, quiet=True, store=Store(where))
    picks = Picks(stats, space, adapter, quiet=True)
    assert picks.on_disk == (where == "disk")
    rng = random.Random(0)
    seeds = list(seed_genomes(space, stats.bypass_order(), rng).values())
    genomes = seeds + [g for g in (space.mutate(seeds[0], rng, stats.bypass_order()) for _ in range(12)) if g]
    last = seeds[0].heads[-1]
    late = replace(seeds[0], heads=(*seeds[0].heads[:-1], 1 if last == 0 else 0))  # differs in the last block only
    genomes += [seeds[0], late]
    held = [s for s, h in zip(seqs, heldout, strict=True) if h]
    batches = [torch.stack(held[:2])[:, :24], torch.stack(held[2:4])[:, :24]]
    with torch.no_grad():
        reference = [torch.log_softmax(model(input_ids=b, use_cache=False).logits.float(), -1) for b in batches]
    with Candidates(model, adapter, picks, batches) as cand:
        for genome in genomes:
            before = cand.blocks_run
            got = cand.kl(genome)
            assert got == pytest.approx(_full_kl(model, reference, batches), rel=1e-5, abs=1e-10)
        assert cand.blocks_run - before == len(batches)  # the last candidate ran its last block only
    with torch.no_grad():  # the model is itself again: every block's forward and weights back
        again = [torch.log_softmax(model(input_ids=b, use_cache=False).logits.float(), -1) for b in batches]
    for a, b in zip(again, reference, strict=True):
        torch.testing.assert_close(a, b)
    if where == "disk":
        assert not picks._refits or all(isinstance(v[0], int) for v in picks._refits.values())  # sizes, no tensors
        assert any(key[0] == "refit" for key in stats.store)
