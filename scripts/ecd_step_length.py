"""How far one ECD step moves the parameters, as a multiple of ``dt = lr / sqrt(eta)``, for several ``F0``.

ECD moves ``theta`` by ``dt`` times the momentum after its update and before it is renormalised, so
the step length is ``dt * ||p_new||``: it depends on ``F - F0`` (see ``sinv_prune/symmetry/ecd.py``).
Two problems, each with ``lr=1, eta=100`` (the paper code's values, ``dt = 0.1``):

* ``least squares``: a ``Linear(5, 1)`` fitted to 64 noisy points, full batch, 200 steps;
* ``bench_symmetry``: that benchmark's GPT-2 (default size, batches and seed 0) for ``--steps`` steps
  (needs the WikiText-2 text, found as the benchmark finds it; skipped with ``--no-bench``).

    python scripts/ecd_step_length.py      # about a minute on 2 cores
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from sinv_prune.symmetry import ECD

LR, ETA = 1.0, 100.0
DT = LR / math.sqrt(ETA)


def step_lengths(model: torch.nn.Module, loss_fn: Callable[[int], torch.Tensor], F0: float, steps: int):  # noqa: N803
    """Per step: (loss, ||theta_after - theta_before|| / dt)."""
    opt = ECD(model.parameters(), lr=LR, eta=ETA, F0=F0)
    rows = []
    for step in range(steps):

        def closure(step=step):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(step)
            loss.backward()
            return loss.detach()

        before = [p.detach().clone() for p in model.parameters()]
        loss = float(opt.step(closure))
        moved = math.sqrt(
            sum(float((p.detach() - b).pow(2).sum()) for p, b in zip(model.parameters(), before, strict=True))
        )
        rows.append((loss, moved / DT))
    return rows


def describe(label: str, rows) -> str:
    ratios = sorted(r for _, r in rows)
    return (
        f"{label}: loss {rows[0][0]:.4f} -> {rows[-1][0]:.4f}; step/dt first {rows[0][1]:.3f}, min {ratios[0]:.3f}, "
        f"median {ratios[len(ratios) // 2]:.3f}, max {ratios[-1]:.3f}; steps that did not move: "
        f"{sum(r == 0 for r in ratios)} of {len(rows)}"
    )


def least_squares() -> None:
    torch.manual_seed(0)
    X, w = torch.randn(64, 5), torch.randn(5, 1)  # noqa: N806
    y = X @ w + 0.1 + 0.3 * torch.randn(64, 1)
    A = torch.cat([X, torch.ones(64, 1)], dim=1)  # noqa: N806
    floor = float(((A @ torch.linalg.lstsq(A, y).solution - y) ** 2).mean())
    print(f"least squares: Linear(5, 1), 64 points, full batch, 200 steps; floor {floor:.4f}; dt = {DT}")
    for F0 in (-10.0, 0.0, floor - 0.02, 2.0):  # noqa: N806
        torch.manual_seed(1)
        model = torch.nn.Linear(5, 1)

        def loss_fn(_, model=model):
            return ((model(X) - y) ** 2).mean()

        rows = step_lengths(model, loss_fn, F0, 200)
        print("  " + describe(f"F0 {F0:7.4f}", rows))


def bench_model(wikitext_dir: Path, steps: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_symmetry as bench

    args = bench.parse_args(["--steps", str(steps), "--wikitext-dir", str(wikitext_dir), "--data", "wikitext"])
    data = bench.load_data(args)
    ids, starts = data["train_ids"], bench.batch_starts(data["train_ids"].numel(), args, 0)
    offsets = torch.arange(args.seq_len)
    print(f"bench_symmetry model: GPT-2 {args.layers} layers, d_model {args.d_model}, batch {args.batch} x "
          f"{args.seq_len}, seed 0, {steps} steps; dt = {DT}")  # fmt: skip
    for F0 in (0.0, 2.0):  # noqa: N806
        model = bench.make_model(args, data["info"]["vocab_size"], 0).train()

        def loss_fn(step, model=model):
            x = ids[starts[step][:, None] + offsets]
            return model(input_ids=x, labels=x).loss

        print("  " + describe(f"F0 {F0:3.1f}", step_lengths(model, loss_fn, F0, steps)))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    here = Path(__file__).resolve()
    default = os.environ.get("SINV_PRUNE_WIKITEXT", here.parents[2] / "shared" / "data" / "wikitext-2")
    p.add_argument("--wikitext-dir", type=Path, default=Path(default), help="WikiText-2 valid.txt and test.txt")
    p.add_argument("--steps", type=int, default=40, help="steps on the bench_symmetry model")
    p.add_argument("--no-bench", action="store_true", help="only the least-squares problem")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    least_squares()
    if not args.no_bench:
        bench_model(args.wikitext_dir, args.steps)


if __name__ == "__main__":
    main()
