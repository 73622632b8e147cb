"""Benchmark the symmetry-breaking paper's optimizer claim at toy scale on two CPU cores.

A small GPT-2 (word-level tokenizer) is trained from scratch with AdamW, SGD with momentum and
ECD (``sinv_prune.symmetry``), each with and without the paper's symmetry-breaking biases
(``add_symmetry_breaking`` with its defaults: ``b_Q ~ N(0.5, diag(linspace(0.05, 0.15, d_head))^2)``,
``b_V ~ N(0.5, 0.05^2 I)``), over several seeds with the same token budget per run. Reported:

* final loss on held-out text, mean ± sample std over seeds (nats per token, evaluation mode,
  so the biases are at their mean ``E[b]``);
* optimizer state memory in bytes per parameter (``optimizer_state_bytes_per_param``);
* the mean ``C_Q`` over all heads (``head_measures(model, keys=["C_Q"])``) every ``K`` steps,
  plotted against the step for each optimizer with and without breaking.

Data: WikiText-2 has no training split on this machine (``../shared/data/wikitext-2`` holds the
validation and test splits only), so the model **trains on ``valid.txt`` and is evaluated on
``test.txt``**; the table says so. The tokenizer is trained on ``valid.txt`` (the most frequent
``--vocab`` words; the rest become ``[UNK]``, on both splits). Without the WikiText-2 files
``--data synthetic`` (and ``--quick``, automatically) uses ``sinv_prune.data.synthetic_corpus``.

Training: batches of ``--batch`` random windows of ``--seq-len`` tokens, the same windows for
every optimizer / breaking arm of a seed; constant learning rate, no warm-up; dropout 0.
Every optimizer steps through a closure (forward + backward), which ECD needs for the loss value.
AdamW and SGD clip the gradient norm at ``--clip``; ECD is never clipped (clipping would change
the gradient that ``F - F0`` pairs with).

ECD runs with the paper code's ``lr=1, eta=100, nu=0`` and ``F0=0`` (the paper code's 2.0 with
``--ecd-f0 2``). ``F0`` must stay below every loss the run reaches (a step with ``F <= F0`` does
nothing; the run counts such steps); cross-entropy is never negative, so 0 can never be crossed.
In the ``ECD_{q=1}`` update ``F0`` sets, through ``1/(F - F0)``, how fast the momentum turns
towards ``-g`` and how long each step is (``scripts/ecd_step_length.py``). In one-seed sweeps at
this scale (F0 = 0, 2, 4 at 100 steps; -2, 0, 2 at the default 200) 0 gave the lowest loss
(docs/symmetry.md).

    python scripts/bench_symmetry.py                       # default budget, ~15 min on 2 cores
    python scripts/bench_symmetry.py --quick --json q.json --plot q.png   # < 2 min

``--preset nanogpt`` runs the comparison at nanoGPT's small-GPT scale (the paper pretrains 124M GPT-2 with
nanoGPT): 6 layers x 6 heads x 384, context 256, a word-level vocabulary of 8,192, AdamW at lr 1e-3,
1,000 steps of 16 x 256 tokens, 3 seeds, C_Q every 50 steps: a GPU job (``--device cuda``; 18 runs).
On WikiText-2 ``valid.txt`` (~0.2M words) that budget is ~19 passes over the training text, so the
held-out loss also measures over-fitting; the training-loss trajectory (second table) shows the
optimization speed on its own.

    python scripts/bench_symmetry.py --preset nanogpt --device cuda --json n.json --plot n.png
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402

from sinv_prune.data import synthetic_corpus, token_ids, train_tokenizer
from sinv_prune.pipeline.evaluation import perplexity
from sinv_prune.scoring.measures import head_measures
from sinv_prune.symmetry import (
    DEFAULT_B_Q,
    DEFAULT_B_V,
    add_symmetry_breaking,
    build_optimizer,
    optimizer_state_bytes_per_param,
)

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext-2"
OPTIMIZERS = ("adamw", "sgd", "ecd")
LABELS = {"adamw": "AdamW", "sgd": "SGD-momentum", "ecd": "ECD"}

DEFAULTS = dict(  # default mode: about 10-15 minutes on 2 CPU cores (18 runs)
    layers=2, d_model=128, heads=4, vocab=4096, seq_len=64, batch=12, steps=200, seeds=3,
    measure_every=20, eval_tokens=32768,
)  # fmt: skip
QUICK = dict(  # --quick: well under 2 minutes
    layers=2, d_model=64, heads=4, vocab=1024, seq_len=32, batch=8, steps=30, seeds=1,
    measure_every=10, eval_tokens=4096,
)  # fmt: skip
NANOGPT = dict(  # --preset nanogpt: nanoGPT's small GPT (6 x 6 x 384, context 256); a GPU job
    layers=6, d_model=384, heads=6, vocab=8192, seq_len=256, batch=16, steps=1000, seeds=3,
    measure_every=50, eval_tokens=262144, adamw_lr=1e-3,
)  # fmt: skip
LR_DEFAULTS = dict(adamw_lr=2e-3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, one seed (< 2 minutes)")
    p.add_argument(
        "--preset", choices=("toy", "nanogpt"), default="toy", help="toy (default; CPU) or nanogpt (6x6x384; GPU)"
    )
    p.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    p.add_argument(
        "--report", type=Path, metavar="JSON", help="print the tables of an earlier --json file (and --plot)"
    )
    p.add_argument("--steps", type=int, help="optimizer steps per run (same for every run)")
    p.add_argument("--seeds", type=int, help="seeds per optimizer and breaking setting (0, 1, ...)")
    p.add_argument("--json", type=Path, help="write every number (runs, trajectories, summary) here")
    p.add_argument("--plot", type=Path, help="PNG of mean C_Q (and training loss) vs step")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: small models run best on one)")
    p.add_argument("--optimizers", default=",".join(OPTIMIZERS), help="comma-separated subset of adamw,sgd,ecd")
    p.add_argument("--breaking", choices=("both", "on", "off"), default="both", help="which arms to run")
    p.add_argument(
        "--data",
        choices=("auto", "wikitext", "synthetic"),
        default="auto",
        help="auto: WikiText-2 where present; else synthetic with --quick, an error without",
    )
    p.add_argument("--wikitext-dir", type=Path, default=Path(os.environ.get("SINV_PRUNE_WIKITEXT", WIKITEXT)))
    for name in ("layers", "d_model", "heads", "vocab", "seq_len", "batch", "measure_every", "eval_tokens"):
        p.add_argument("--" + name.replace("_", "-"), type=int, dest=name)
    p.add_argument("--adamw-lr", type=float, help="default 2e-3 (1e-3 with --preset nanogpt)")
    p.add_argument("--sgd-lr", type=float, default=0.1)
    p.add_argument("--sgd-momentum", type=float, default=0.9)
    p.add_argument("--ecd-lr", type=float, default=1.0)
    p.add_argument("--ecd-eta", type=float, default=100.0)
    p.add_argument(
        "--ecd-f0",
        type=float,
        default=0.0,
        help="ECD's F0, below every training loss reached (default 0: cross-entropy never goes below it)",
    )
    p.add_argument("--clip", type=float, default=1.0, help="gradient-norm clip for AdamW and SGD (0: off); never ECD")
    args = p.parse_args(argv)
    if args.quick and args.preset != "toy":
        p.error("--quick is the toy preset's short mode; drop it with --preset nanogpt (or set --steps)")
    base = {**LR_DEFAULTS, **(QUICK if args.quick else NANOGPT if args.preset == "nanogpt" else DEFAULTS)}
    for key, value in base.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.optimizers = [o.strip().lower() for o in args.optimizers.split(",") if o.strip()]
    bad = set(args.optimizers) - set(OPTIMIZERS)
    if bad or not args.optimizers:
        p.error(f"--optimizers: choose from {', '.join(OPTIMIZERS)} (got {args.optimizers})")
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    if min(args.steps, args.seeds, args.measure_every, args.batch, args.seq_len) < 1:
        p.error("--steps, --seeds, --measure-every, --batch and --seq-len must be >= 1")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device: expected cpu, cuda, cuda:N or auto, got {args.device!r}")
    if device.type not in ("cpu", "cuda"):
        p.error(f"--device: expected cpu, cuda, cuda:N or auto, got {args.device!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error(f"--device {args.device}: torch sees no CUDA device")
    return args


# ---------------------------------------------------------------------------------------------- data
def load_data(args) -> dict:
    """Token streams for training and evaluation, the tokenizer and a description of both."""
    valid, test = args.wikitext_dir / "valid.txt", args.wikitext_dir / "test.txt"
    have_wikitext = valid.is_file() and test.is_file()
    kind = args.data
    if kind == "auto":
        if have_wikitext:
            kind = "wikitext"
        elif args.quick:
            kind = "synthetic"
        else:
            sys.exit(f"WikiText-2 text not found in {args.wikitext_dir} (valid.txt, test.txt); "
                     "pass --wikitext-dir, or --data synthetic")  # fmt: skip
    if kind == "wikitext":
        if not have_wikitext:
            sys.exit(f"--data wikitext: valid.txt and test.txt not found in {args.wikitext_dir}")
        train_lines = valid.read_text(encoding="utf-8").splitlines()
        eval_lines = test.read_text(encoding="utf-8").splitlines()
        train_name, eval_name = "WikiText-2 valid.txt", "WikiText-2 test.txt"
        note = "WikiText-2 has no train split here: trained on valid.txt, evaluated on test.txt"
    else:
        corpus = synthetic_corpus(num_train=4000 if args.quick else 20000, num_valid=10, num_test=600, seed=0)
        train_lines, eval_lines = corpus["train"]["text"], corpus["test"]["text"]
        train_name, eval_name = "synthetic_corpus(seed=0) train", "synthetic_corpus(seed=0) test"
        note = "synthetic corpus (sinv_prune.data.synthetic_corpus), not WikiText-2"
    tokenizer = train_tokenizer(train_lines, "word", vocab_size=args.vocab)
    train_ids, eval_ids = token_ids(train_lines, tokenizer), token_ids(eval_lines, tokenizer)
    unk = tokenizer.unk_token_id
    return {
        "kind": kind, "tokenizer": tokenizer, "train_ids": train_ids, "eval_ids": eval_ids[: args.eval_tokens],
        "info": {
            "kind": kind, "train": train_name, "eval": eval_name, "note": note,
            "tokenizer": f"word-level, {len(tokenizer)} tokens, trained on {train_name}",
            "vocab_size": len(tokenizer), "train_tokens": train_ids.numel(),
            "eval_tokens": min(eval_ids.numel(), args.eval_tokens), "eval_tokens_available": eval_ids.numel(),
            "unk_rate_train": float((train_ids == unk).float().mean()),
            "unk_rate_eval": float((eval_ids[: args.eval_tokens] == unk).float().mean()),
        },
    }  # fmt: skip


def batch_starts(num_tokens: int, args, seed: int) -> torch.Tensor:
    """``[steps, batch]`` window starts: the same for every arm of a seed."""
    g = torch.Generator().manual_seed(10_000 + seed)
    return torch.randint(0, num_tokens - args.seq_len, (args.steps, args.batch), generator=g)


# ---------------------------------------------------------------------------------------------- runs
def make_model(args, vocab_size: int, seed: int) -> transformers.GPT2LMHeadModel:
    config = transformers.GPT2Config(
        vocab_size=vocab_size, n_positions=args.seq_len, n_embd=args.d_model, n_layer=args.layers, n_head=args.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def optimizer_kwargs(name: str, args) -> dict:
    if name == "adamw":
        return {"lr": args.adamw_lr}
    if name == "sgd":
        return {"lr": args.sgd_lr, "momentum": args.sgd_momentum}
    return {"lr": args.ecd_lr, "eta": args.ecd_eta, "F0": args.ecd_f0}


def mean_c_q(model) -> tuple[float, list[list[float]]]:
    per_layer = head_measures(model, keys=["C_Q"])["C_Q"]
    values = [v for layer in per_layer for v in layer]
    return math.fsum(values) / len(values), per_layer


def train_run(name: str, breaking: bool, seed: int, args, data: dict) -> dict:
    model = make_model(args, data["info"]["vocab_size"], seed).to(args.device)  # same init draw on any device
    if breaking:
        add_symmetry_breaking(model, seed=seed)  # the paper's default distributions
    model.train()
    opt = build_optimizer(name, model.parameters(), **optimizer_kwargs(name, args))
    clip = args.clip if name != "ecd" and args.clip > 0 else None
    ids, starts = data["train_ids"], batch_starts(data["train_ids"].numel(), args, seed)
    offsets = torch.arange(args.seq_len)
    traj = {"step": [], "C_Q_mean": [], "train_loss": []}
    window: list[float] = []
    below_f0 = 0
    t0 = time.perf_counter()
    c_q0, _ = mean_c_q(model)
    traj["step"].append(0), traj["C_Q_mean"].append(c_q0), traj["train_loss"].append(None)
    for step in range(1, args.steps + 1):
        x = ids[starts[step - 1][:, None] + offsets].to(args.device)

        def closure(x=x):
            opt.zero_grad(set_to_none=True)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            return loss.detach()

        loss = float(opt.step(closure))
        if not math.isfinite(loss):
            raise FloatingPointError(f"{name} breaking={breaking} seed={seed}: loss {loss} at step {step}")
        if name == "ecd" and loss <= args.ecd_f0:
            below_f0 += 1
        window.append(loss)
        if step % args.measure_every == 0 or step == args.steps:
            c_q, _ = mean_c_q(model)
            traj["step"].append(step), traj["C_Q_mean"].append(c_q)
            traj["train_loss"].append(statistics.fmean(window))
            window = []
    train_s = time.perf_counter() - t0
    state = optimizer_state_bytes_per_param(opt)
    ev = perplexity(model, data["eval_ids"], seq_len=args.seq_len, batch_size=32, device=args.device, progress=False)
    c_q_final, per_layer = mean_c_q(model)
    return {
        "optimizer": name, "breaking": breaking, "seed": seed, "optimizer_kwargs": optimizer_kwargs(name, args),
        "clip": clip, "eval_loss": ev["nll"], "eval_ppl": ev["perplexity"], "eval_scored_tokens": ev["tokens"],
        "state_bytes_per_param": state, "C_Q_start": c_q0, "C_Q_end": c_q_final, "C_Q_end_per_layer": per_layer,
        "steps_below_F0": below_f0 if name == "ecd" else None, "train_seconds": train_s,
        "seconds": time.perf_counter() - t0, "trajectory": traj,
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------- report
def mean_std(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def pm(mean: float, std: float | None, digits: int = 3) -> str:
    return f"{mean:.{digits}f} ± {std:.{digits}f}" if std is not None else f"{mean:.{digits}f}"


def summarise(runs: list[dict]) -> list[dict]:
    out = []
    for name in OPTIMIZERS:
        for breaking in (False, True):
            mine = [r for r in runs if r["optimizer"] == name and r["breaking"] == breaking]
            if not mine:
                continue
            loss_m, loss_s = mean_std([r["eval_loss"] for r in mine])
            start_m, _ = mean_std([r["C_Q_start"] for r in mine])
            end_m, end_s = mean_std([r["C_Q_end"] for r in mine])
            out.append({
                "optimizer": name, "breaking": breaking, "seeds": [r["seed"] for r in mine],
                "eval_loss_mean": loss_m, "eval_loss_std": loss_s,
                "eval_ppl_of_mean_loss": math.exp(loss_m),
                "state_bytes_per_param": statistics.fmean(r["state_bytes_per_param"] for r in mine),
                "C_Q_start_mean": start_m, "C_Q_end_mean": end_m, "C_Q_end_std": end_s,
                "seconds_per_run": statistics.fmean(r["seconds"] for r in mine),
            })  # fmt: skip
    return out


def paired_effects(runs: list[dict]) -> list[dict]:
    """Per optimizer: eval loss with breaking minus without, paired by seed (same init draw, same batches)."""
    out = []
    for name in OPTIMIZERS:
        diffs = []
        for r in runs:
            if r["optimizer"] == name and r["breaking"]:
                twin = [s for s in runs if s["optimizer"] == name and not s["breaking"] and s["seed"] == r["seed"]]
                if twin:
                    diffs.append(r["eval_loss"] - twin[0]["eval_loss"])
        if diffs:
            m, s = mean_std(diffs)
            out.append({"optimizer": name, "diffs": diffs, "mean": m, "std": s,
                        "improved_seeds": sum(d < 0 for d in diffs), "n": len(diffs)})  # fmt: skip
    return out


def table(summary: list[dict], effects: list[dict], info: dict, n_seeds: int) -> str:
    head = (f"{'optimizer':<13} {'breaking':<9} {'eval loss (nats), mean ± std':>29} {'ppl':>7} "
            f"{'state B/param':>13} {'C_Q start':>9} {'C_Q end':>15} {'s/run':>6}")  # fmt: skip
    lines = [f"Final loss on {info['eval']} (model trained on {info['train']}), {n_seeds} seed(s) each", head,
             "-" * len(head)]  # fmt: skip
    for row in summary:
        lines.append(
            f"{LABELS[row['optimizer']]:<13} {'b_Q+b_V' if row['breaking'] else 'none':<9} "
            f"{pm(row['eval_loss_mean'], row['eval_loss_std']):>29} {row['eval_ppl_of_mean_loss']:>7.1f} "
            f"{row['state_bytes_per_param']:>13.2f} {row['C_Q_start_mean']:>9.4f} "
            f"{pm(row['C_Q_end_mean'], row['C_Q_end_std'], 4):>15} {row['seconds_per_run']:>6.1f}"
        )
    if effects:
        lines += ["", "Effect of breaking on eval loss, paired by seed (with - without; negative = breaking helps):"]
        for e in effects:
            diffs = ", ".join(f"{d:+.3f}" for d in e["diffs"])
            lines.append(
                f"  {LABELS[e['optimizer']]:<13} {pm(e['mean'], e['std']):>16}   per seed [{diffs}]   "
                f"lower with breaking in {e['improved_seeds']}/{e['n']} seeds"
            )
    return "\n".join(lines)


def trajectory_table(runs: list[dict]) -> str:
    """Mean over seeds of the mean C_Q, and of the training loss, at every measured step, per arm."""
    steps = runs[0]["trajectory"]["step"]
    lines = []
    for key, what in (
        ("C_Q_mean", "Mean C_Q over all heads"),
        ("train_loss", "Training loss (mean of the steps since the previous column)"),
    ):
        lines += [
            f"{what}, mean over seeds, at step:",
            f"{'optimizer':<13} {'breaking':<9}" + "".join(f"{s:>7}" for s in steps),
        ]
        for name in OPTIMIZERS:
            for breaking in (False, True):
                mine = [r for r in runs if r["optimizer"] == name and r["breaking"] == breaking]
                if not mine:
                    continue
                cells = []
                for i in range(len(steps)):
                    values = [r["trajectory"][key][i] for r in mine if r["trajectory"][key][i] is not None]
                    digits = 4 if key == "C_Q_mean" else 3
                    cells.append(f"{statistics.fmean(values):>7.{digits}f}" if values else f"{'-':>7}")
                lines.append(f"{LABELS[name]:<13} {'b_Q+b_V' if breaking else 'none':<9}" + "".join(cells))
        lines.append("")
    return "\n".join(lines[:-1])


def plot(runs: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    names = [n for n in OPTIMIZERS if any(r["optimizer"] == n for r in runs)]
    fig, axes = plt.subplots(2, len(names), figsize=(4.3 * len(names), 6.4), squeeze=False, sharex=True)
    for col, name in enumerate(names):
        for breaking, color in ((False, "tab:blue"), (True, "tab:red")):
            mine = [r for r in runs if r["optimizer"] == name and r["breaking"] == breaking]
            if not mine:
                continue
            label = "with b_Q, b_V" if breaking else "without"
            steps = mine[0]["trajectory"]["step"]
            for row, key in ((0, "C_Q_mean"), (1, "train_loss")):
                ax = axes[row][col]
                series = torch.tensor([[float("nan") if v is None else v for v in r["trajectory"][key]] for r in mine])
                mean = series.mean(0)
                ax.plot(steps, mean.tolist(), color=color, linewidth=2, label=f"{label} (mean of {len(mine)})")
                if len(mine) > 1:  # each seed thin: seeds start at different C_Q, a band would hide the drift
                    for one in series:
                        ax.plot(steps, one.tolist(), color=color, linewidth=0.7, alpha=0.45)
        axes[0][col].set_title(LABELS[name], fontsize=10)
        axes[0][col].set_ylabel("mean C_Q over heads")
        axes[1][col].set_ylabel(f"training loss (mean of the last {runs[0]['trajectory']['step'][1]} steps)")
        axes[1][col].set_xlabel("step")
        axes[0][col].legend(fontsize=8)
    fig.suptitle(title + "\nthick: mean over seeds; thin: each seed", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- main
def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    words = [sys.argv[0], *sys.argv[1:]] if argv is None else ["scripts/bench_symmetry.py", *argv]
    command = "python " + shlex.join(words)
    print(f"$ {command}", flush=True)
    if args.report:
        return report(args)
    t_start = time.perf_counter()
    data = load_data(args)
    info = data["info"]
    model = make_model(args, info["vocab_size"], 0)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    tokens_per_run = args.steps * args.batch * args.seq_len
    arms = [b for b in (False, True) if args.breaking == "both" or (args.breaking == "on") == b]
    gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__} with "
          f"{args.threads} thread(s); device {args.device}{', GPU ' + gpu if gpu else ''}; "
          f"preset {args.preset}")  # fmt: skip
    print(f"data: {info['note']}")
    print(f"  train {info['train']}: {info['train_tokens']} tokens; eval {info['eval']}: first {info['eval_tokens']} "
          f"of {info['eval_tokens_available']} tokens, windows of {args.seq_len} (stride {args.seq_len}); "
          f"[UNK] rate {info['unk_rate_train']:.3f} train, {info['unk_rate_eval']:.3f} eval")  # fmt: skip
    print(f"  tokenizer: {info['tokenizer']}")
    print(f"model: GPT-2, {args.layers} layers, d_model {args.d_model}, {args.heads} heads (head_dim "
          f"{args.d_model // args.heads}), {n_params} parameters (tied embeddings), dropout 0")  # fmt: skip
    print(f"budget: {args.steps} steps x {args.batch} x {args.seq_len} = {tokens_per_run} tokens per run "
          f"({tokens_per_run / info['train_tokens']:.2f} passes over the training text); C_Q every "
          f"{args.measure_every} steps")  # fmt: skip
    print(f"optimizers: AdamW lr {args.adamw_lr} (torch defaults otherwise, weight_decay 0.01); SGD lr {args.sgd_lr} "
          f"momentum {args.sgd_momentum}; clip {args.clip or 'off'} for both; ECD lr {args.ecd_lr} eta "
          f"{args.ecd_eta} F0 {args.ecd_f0} nu 0, no clipping; constant lr, no warm-up")  # fmt: skip
    print("breaking: b_Q ~ N(0.5, diag(linspace(0.05, 0.15, d_head))^2), b_V ~ N(0.5, 0.05^2 I) (paper defaults), "
          "redrawn every training forward, E[b] at evaluation")  # fmt: skip
    runs = []
    for seed in range(args.seeds):
        for name in args.optimizers:
            for breaking in arms:
                run = train_run(name, breaking, seed, args, data)
                runs.append(run)
                extra = f"  steps with loss <= F0: {run['steps_below_F0']}" if name == "ecd" else ""
                print(f"  seed {seed} {LABELS[name]:<13} breaking={'on ' if breaking else 'off'} eval loss "
                      f"{run['eval_loss']:.4f}  C_Q {run['C_Q_start']:.4f} -> {run['C_Q_end']:.4f}  "
                      f"{run['seconds']:.1f} s{extra}", flush=True)  # fmt: skip
    summary, effects = summarise(runs), paired_effects(runs)
    text = table(summary, effects, info, args.seeds) + "\n\n" + trajectory_table(runs)
    print()
    print(text)
    result = {
        "command": command, "argv": sys.argv[1:] if argv is None else list(argv),
        "machine": {"cpu_cores": os.cpu_count(), "threads": args.threads, "torch": torch.__version__,
                    "device": args.device, "gpu": gpu,
                    "transformers": transformers.__version__, "platform": platform.platform()},
        "data": info,
        "model": {"arch": "gpt2", "layers": args.layers, "d_model": args.d_model, "heads": args.heads,
                  "head_dim": args.d_model // args.heads, "vocab_size": info["vocab_size"], "seq_len": args.seq_len,
                  "parameters": n_params},
        "settings": {"steps": args.steps, "batch": args.batch, "seq_len": args.seq_len, "seeds": args.seeds,
                     "tokens_per_run": tokens_per_run, "measure_every": args.measure_every,
                     "eval_tokens": info["eval_tokens"], "clip": args.clip,
                     "optimizers": {n: optimizer_kwargs(n, args) for n in args.optimizers},
                     "b_q": DEFAULT_B_Q.to_json(), "b_v": DEFAULT_B_V.to_json(), "quick": args.quick,
                     "preset": args.preset, "device": args.device},
        "runs": runs, "summary": summary, "breaking_effect": effects, "table": text, "plot": None,
    }  # fmt: skip
    if args.plot:
        title = f"GPT-2 {args.layers}L d{args.d_model}, {tokens_per_run} tokens/run, trained on {info['train']}"
        plot(runs, args.plot, title)
        result["plot"] = str(args.plot)
        print(f"\nplot: {args.plot}")
    result["total_seconds"] = time.perf_counter() - t_start
    print(f"total: {result['total_seconds']:.0f} s")
    if args.json:
        common.write_json(args.json, result, say=False)
        print(f"json: {args.json}")
    return result


def report(args) -> dict:
    """The tables (and with ``--plot`` the figure) of a finished run, from its ``--json`` file."""
    result = json.loads(args.report.read_text())
    runs, info, model = result["runs"], result["data"], result["model"]
    print(f"report of {args.report}, written by: $ {result['command']}")
    print(f"data: {info['note']}; model: GPT-2, {model['layers']} layers, d_model {model['d_model']}, "
          f"{model['parameters']} parameters; {result['settings']['tokens_per_run']} tokens per run")  # fmt: skip
    seeds = len({r["seed"] for r in runs})
    text = table(summarise(runs), paired_effects(runs), info, seeds) + "\n\n" + trajectory_table(runs)
    print()
    print(text)
    if args.plot:
        title = f"GPT-2 {model['layers']}L d{model['d_model']}, {result['settings']['tokens_per_run']} tokens/run, "
        plot(runs, args.plot, title + f"trained on {info['train']}")
        print(f"\nplot: {args.plot}")
    return {**result, "table": text, "plot": str(args.plot) if args.plot else None}


if __name__ == "__main__":
    main()
