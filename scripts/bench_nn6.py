"""The NN6 paper's protocol ("The S-Invariant Attractor for Transformers"), scaled to this machine.

A 6-layer, 8-head GPT-2 is trained from scratch on WikiText-2 (word level) for a fixed number of
epochs, several seeds, measuring ``head_measures`` (C_Q, C_V, C_FF) with ``sinv_prune.track`` before
training and after every epoch (the trace ``sinv_early`` reads). The paper's claims, one by one:

1. heads reach C_Q < 0.05 (when, in which layers; the first two layers converge, layers 5-6 do not;
   heads of one layer converge at very different rates);
2. the S-invariant stopping rule (every C_Q, C_V, C_FF below 0.05) against early stopping on the dev
   loss with patience 5 and 10 (best epoch restored), by test perplexity and epochs trained; the rules
   are applied to the same runs after the fact (same weights, so the comparison is paired);
3. pruning 5 heads (10.4% of 48) of the best-dev checkpoint by ``sinv_early`` (threshold 0.05, first
   15 epochs), ``random`` (several seeds), ``magnitude`` and ``taylor`` (scored on training batches):
   test perplexity and exact parameter counts, no fine-tune;
4. the arithmetic of "44M -> 37M parameters from 5 of 48 heads" for a 6 x 8 GPT-2 with d_model 512.

Data: WikiText-2 has no training split here, so the model trains on ``valid.txt`` minus its last
``--dev-fraction`` (the dev part, used for early stopping) and is reported on ``test.txt``; where a
``train.txt`` sits next to them (``SINV_PRUNE_WIKITEXT``) it trains on that and uses all of valid as dev.
The default scale fits 2 CPU cores: d_model 64, a word vocabulary of the most frequent 2,048 training
words (others -> [UNK], so perplexities are not comparable with the paper's full-vocabulary 66.3),
a capped training stream. ``--paper-scale`` runs d_model 512, the full vocabulary, all the text,
50 epochs and 5 seeds (for a GPU).

    python scripts/bench_nn6.py --plot docs/bench_nn6.png --json bench_nn6.json
    python scripts/bench_nn6.py --quick
    python scripts/bench_nn6.py --paper-scale --device cuda
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402

from sinv_prune import HeadPruner, count_parameters, prune_heads, stop_rule, track  # noqa: E402
from sinv_prune.data import token_ids, train_tokenizer  # noqa: E402
from sinv_prune.pipeline.evaluation import perplexity  # noqa: E402
from sinv_prune.pipeline.tracking import rule_max  # noqa: E402

THRESHOLD = 0.05  # the paper's
PAPER = {
    "stop_sinv": "66.3 ± 0.3",
    "patience_5": "68.2 ± 0.8",
    "patience_10": "67.1 ± 0.5",
    "prune": {"none": "66.3", "sinv_early": "66.8", "random": "69.1", "magnitude": "68.7", "taylor": "-"},
}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny model, few epochs (< 1 min)")
    ap.add_argument("--paper-scale", action="store_true", help="d_model 512, full vocabulary and text, 50 epochs, "
                    "5 seeds (for a GPU)")  # fmt: skip
    ap.add_argument("--seeds", type=int, help="training seeds (default 3)")
    ap.add_argument("--epochs", type=int, help="epochs per run (default 25)")
    ap.add_argument("--d-model", type=int, help="width (default 64; 8 heads of d_model/8)")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, help="word vocabulary incl. specials (default 2048; 0: every word)")
    ap.add_argument("--train-tokens", type=int, help="training tokens per epoch (default 30000; 0: all)")
    ap.add_argument("--test-tokens", type=int, help="test tokens evaluated (default 40000; 0: all)")
    ap.add_argument("--dev-tokens", type=int, help="dev tokens evaluated every epoch (default 0: all)")
    ap.add_argument("--dev-fraction", type=float, default=0.1, help="last part of valid.txt held out as dev")
    ap.add_argument("--seq-len", type=int, help="block length (default 64)")
    ap.add_argument("--batch", type=int, help="blocks per step (default 16)")
    ap.add_argument("--lr", type=float, help="AdamW peak learning rate (default 2e-3; constant after 1 epoch warm-up)")
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--prune", type=int, default=5, help="heads to prune (paper: 5)")
    ap.add_argument("--random-prune-seeds", type=int, help="random-criterion seeds per run (default 5)")
    ap.add_argument("--sinv-epochs", type=float, default=15, help="sinv_early window in epochs (paper: 15)")
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--plot", type=Path, help="write the C_Q / dev perplexity plot (PNG) here")
    ap.add_argument("--json", type=Path, help="write all results here")
    args = ap.parse_args(argv)
    if args.quick and args.paper_scale:
        ap.error("--quick and --paper-scale exclude each other")
    preset = {  # quick, default, paper scale
        "seeds": (2, 3, 5),
        "epochs": (3, 25, 50),
        "d_model": (32, 64, 512),
        "vocab": (512, 2048, 0),
        "train_tokens": (2000, 30000, 0),
        "test_tokens": (2000, 40000, 0),
        "dev_tokens": (1000, 0, 0),
        "seq_len": (32, 64, 128),
        "batch": (8, 16, 32),
        "lr": (2e-3, 2e-3, 5e-4),
        "random_prune_seeds": (2, 5, 5),
    }
    which = 0 if args.quick else 2 if args.paper_scale else 1
    for key, values in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, values[which])
    if args.quick:
        args.sinv_epochs = min(args.sinv_epochs, 2)
    return args


# -- data ---------------------------------------------------------------------------------------


def load_data(args):
    """Tokenizer and token streams {"train", "dev", "test"}, plus a description of the split."""
    valid = common.read_lines(common.wikitext_file("valid"))
    train_file = common.wikitext_file("train")
    if train_file is not None:
        train_lines, dev_lines = common.read_lines(train_file), valid
        split = "train.txt (train), valid.txt (dev: early stopping), test.txt (report)"
    else:
        cut = int(len(valid) * (1 - args.dev_fraction))
        train_lines, dev_lines = valid[:cut], valid[cut:]
        split = (f"valid.txt lines 1-{cut} (train), lines {cut + 1}-{len(valid)} (dev: early stopping), "
                 f"test.txt (report); WikiText-2 train.txt is not on this machine")  # fmt: skip
    tokenizer = train_tokenizer(train_lines, kind="word", vocab_size=args.vocab or None)
    streams = {
        "train": token_ids(train_lines, tokenizer),
        "dev": token_ids(dev_lines, tokenizer),
        "test": token_ids(common.read_lines(common.wikitext_file("test")), tokenizer),
    }
    full = {k: int(v.numel()) for k, v in streams.items()}
    if args.train_tokens:
        streams["train"] = streams["train"][: args.train_tokens]
    if args.test_tokens:
        streams["test"] = streams["test"][: args.test_tokens]
    if args.dev_tokens:
        streams["dev"] = streams["dev"][: args.dev_tokens]
    unk = tokenizer.unk_token_id
    info = {
        "split": split,
        "vocab": len(tokenizer),
        "tokens": {k: int(v.numel()) for k, v in streams.items()},
        "tokens_available": full,
        "unk_rate": {k: round(float((v == unk).float().mean()), 4) for k, v in streams.items()},
    }
    return tokenizer, streams, info


def blocks(ids: torch.Tensor, seq_len: int) -> torch.Tensor:
    n = ids.numel() // seq_len
    return ids[: n * seq_len].view(n, seq_len)


# -- model and training ---------------------------------------------------------------------------


def build(args, vocab: int, seed: int, tokenizer):
    import transformers

    config = transformers.GPT2Config(vocab_size=vocab, n_positions=max(args.seq_len, 64), n_embd=args.d_model,
                                     n_layer=args.layers, n_head=args.heads, resid_pdrop=args.dropout,
                                     embd_pdrop=args.dropout, attn_pdrop=args.dropout,
                                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                     pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(config)


def dev_ppl(model, ids, args, device) -> float:
    return perplexity(model, ids, seq_len=args.seq_len, batch_size=64, device=device, progress=False)["perplexity"]


def train_run(args, seed: int, streams, tokenizer, device, trace_path: Path) -> dict:
    """One seed: train ``--epochs`` epochs; returns per-epoch records, state dicts and the trace records."""
    model = build(args, len(tokenizer), seed, tokenizer).to(device)
    train = blocks(streams["train"], args.seq_len)
    steps_per_epoch = math.ceil(len(train) / args.batch)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95))  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / steps_per_epoch))
    gen = torch.Generator().manual_seed(seed)
    records = [track(model, trace_path, 0, epoch=0.0, dev_ppl=dev_ppl(model, streams["dev"], args, device))]
    epochs, states, step = [], [], 0
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        model.train()
        order = torch.randperm(len(train), generator=gen)
        losses = []
        for i in range(0, len(train), args.batch):
            batch = train[order[i : i + args.batch]].to(device)
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
            step += 1
        model.eval()
        dev = dev_ppl(model, streams["dev"], args, device)
        rec = track(model, trace_path, step, epoch=float(epoch), loss=statistics.fmean(losses), dev_ppl=dev)
        records.append(rec)
        states.append({k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()})
        epochs.append({"epoch": epoch, "train_loss": statistics.fmean(losses), "dev_ppl": dev,
                       "rule_max": rule_max(rec), "seconds": round(time.perf_counter() - t0, 2)})  # fmt: skip
    return {"model": model, "epochs": epochs, "states": states, "records": records}


# -- stopping rules --------------------------------------------------------------------------------


def patience_stop(dev: list[float], patience: int) -> tuple[int, int]:
    """(epoch training stops at, best epoch restored): stop once ``patience`` epochs pass without a new best."""
    best, best_epoch = math.inf, 0
    for epoch, value in enumerate(dev, start=1):
        if value < best:
            best, best_epoch = value, epoch
        elif epoch - best_epoch >= patience:
            return epoch, best_epoch
    return len(dev), best_epoch


def sinv_stop(records: list[dict]) -> int | None:
    """First epoch whose measurement satisfies the paper's rule (every C_Q, C_V, C_FF < 0.05), else None."""
    for rec in records[1:]:
        if stop_rule(rec, THRESHOLD):
            return int(rec["epoch"])
    return None


def test_ppl_at(run, epoch: int, streams, args, device, cache: dict) -> float:
    if epoch not in cache:
        model = run["model"]
        model.load_state_dict(run["states"][epoch - 1])
        cache[epoch] = perplexity(model, streams["test"], seq_len=args.seq_len, batch_size=64, device=device,
                                  progress=False)["perplexity"]  # fmt: skip
    return cache[epoch]


# -- head statistics --------------------------------------------------------------------------------


def head_stats(records: list[dict], sinv_epochs: float) -> dict:
    """Per layer C_Q over the run: at init, at ``sinv_epochs``, at the end, the lowest reached; crossings."""
    cq = [r["C_Q"] for r in records]  # [time][layer][head]
    ep = [r["epoch"] for r in records]
    at = max(i for i, e in enumerate(ep) if e <= sinv_epochs)
    layers = []
    for layer in range(len(cq[0])):
        series = [[t[layer][h] for t in cq] for h in range(len(cq[0][layer]))]
        crossing = [next((ep[i] for i, v in enumerate(s) if v < THRESHOLD), None) for s in series]
        layers.append({
            "init_mean": statistics.fmean(cq[0][layer]),
            "init_spread": max(cq[0][layer]) - min(cq[0][layer]),
            "window_mean": statistics.fmean(cq[at][layer]),
            "final_mean": statistics.fmean(cq[-1][layer]),
            "final_min": min(cq[-1][layer]),
            "final_max": max(cq[-1][layer]),
            "lowest": min(min(s) for s in series),
            "crossed": sum(c is not None for c in crossing),
            "first_crossing": min((c for c in crossing if c is not None), default=None),
        })  # fmt: skip
    flat = [(v, i, layer, h) for i, t in enumerate(cq) for layer, row in enumerate(t) for h, v in enumerate(row)]
    low = min(flat)
    return {"layers": layers, "window_epoch": ep[at],
            "lowest": {"C_Q": low[0], "epoch": ep[low[1]], "layer": low[2], "head": low[3]},
            "crossed": sum(lay["crossed"] for lay in layers)}  # fmt: skip


# -- pruning ---------------------------------------------------------------------------------------


def prune_arms(run, best_epoch: int, streams, tokenizer, args, device, seed: int) -> list[dict]:
    """5 heads out of the best-dev checkpoint by each criterion; test perplexity and parameters."""
    base = run["model"]
    base.load_state_dict(run["states"][best_epoch - 1])
    base.eval()
    train = blocks(streams["train"], args.seq_len)
    batches = [{"input_ids": train[i : i + args.batch].to(device)} for i in range(0, min(len(train), 8 * args.batch),
                                                                                 args.batch)]  # fmt: skip
    window = [r for r in run["records"] if r["epoch"] <= args.sinv_epochs]
    arms = [("sinv_early", {"trace": window, "threshold": THRESHOLD, "epochs": args.sinv_epochs}, None),
            ("magnitude", {"p": 2}, None), ("taylor", {}, None)]  # fmt: skip
    arms += [("random", {"seed": 1000 * seed + s}, s) for s in range(args.random_prune_seeds)]
    out = []
    for name, opts, rseed in arms:
        pruner = HeadPruner(name, args.prune, mode="global", seed=rseed or 0, criterion_options=opts)
        model = copy.deepcopy(base)
        summary = pruner.prune(model, batches)
        plan = pruner.last_selection["heads"]
        ppl = perplexity(model, streams["test"], seq_len=args.seq_len, batch_size=64, device=device,
                         progress=False)["perplexity"]  # fmt: skip
        report = pruner.parts[0].criterion.report()
        out.append({"criterion": name, "random_seed": rseed, "removed": summary.heads_removed,
                    "selection": {str(k): v for k, v in plan.items()}, "params_before": summary.params_before,
                    "params_after": summary.params_after, "test_ppl": ppl,
                    "crossed": report.get("crossed")})  # fmt: skip
        del model
    return out


# -- the paper's parameter arithmetic ---------------------------------------------------------------


def paper_arithmetic(layers=6, heads=8, d_model=512, pruned=5) -> dict:
    """Exact parameter counts of 6 x 8 GPT-2s with d_model 512 (word-level and GPT-2 vocabularies), 5 heads off."""
    import transformers

    d_head = d_model // heads
    per_head = {"W_Q, W_K, W_V rows": 3 * d_head * d_model, "Q, K, V biases": 3 * d_head,
                "W_O columns": d_model * d_head}  # fmt: skip
    head_total = sum(per_head.values())
    out = {"d_head": d_head, "per_head": per_head, "per_head_total": head_total, "pruned": pruned,
           "removed_by_pruning": pruned * head_total, "all_attention_heads": layers * heads * head_total,
           "claimed_removed": 44_000_000 - 37_000_000, "models": []}  # fmt: skip
    for vocab, name in ((33_278, "WikiText-2 word vocabulary (33,278)"), (50_257, "GPT-2 BPE vocabulary (50,257)")):
        config = transformers.GPT2Config(vocab_size=vocab, n_positions=1024, n_embd=d_model, n_layer=layers,
                                         n_head=heads, bos_token_id=None, eos_token_id=None)  # fmt: skip
        with torch.device("meta"):  # shapes only: no initialisation
            model = transformers.GPT2LMHeadModel(config)
        model.to_empty(device="cpu")  # prune_heads refuses meta weights; uninitialised memory is enough to count
        before = count_parameters(model)
        summary = prune_heads(model, {0: list(range(pruned))})
        out["models"].append({"vocab": name, "before": before, "after": summary.params_after,
                              "removed": before - summary.params_after})  # fmt: skip
        del model
    return out


def print_arithmetic(a: dict) -> None:
    print("Claim 4: '5 heads (10.4%) reduce parameters by 15% (44M to 37M)', 6 layers x 8 heads, d_model 512:")
    terms = " + ".join(f"{k} {v:,}" for k, v in a["per_head"].items())
    print(f"  one head (d_head = 512/8 = {a['d_head']}): {terms} = {a['per_head_total']:,} parameters")
    print(f"  5 heads: 5 x {a['per_head_total']:,} = {a['removed_by_pruning']:,}; all 48 heads: "
          f"48 x {a['per_head_total']:,} = {a['all_attention_heads']:,}")  # fmt: skip
    print(f"  claimed: 44M - 37M = {a['claimed_removed']:,}, i.e. {a['claimed_removed'] / a['per_head_total']:.1f} "
          f"heads' worth, more than all 48 heads hold")  # fmt: skip
    rows = [[m["vocab"], f"{m['before']:,}", f"{m['after']:,}", f"{m['removed']:,}",
             f"{m['removed'] / m['before']:.2%}"] for m in a["models"]]  # fmt: skip
    print(common.table(["GPT-2 6x8x512, n_positions 1024, tied lm_head", "parameters", "after pruning 5 heads",
                        "removed", "share"], rows, "lrrrr"))  # fmt: skip
    print()


# -- output ---------------------------------------------------------------------------------------


def plot(path: Path, runs: list[dict], stops: list[dict], title: str) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 4.4))
    FigureCanvasAgg(fig)
    ax_cq, ax_spread, ax_dev = fig.subplots(1, 3)
    recs = runs[0]["records"]
    ep = [r["epoch"] for r in recs]
    layers = len(recs[0]["C_Q"])
    for layer in range(layers):
        mean = [statistics.fmean(r["C_Q"][layer]) for r in recs]
        lo = [min(r["C_Q"][layer]) for r in recs]
        hi = [max(r["C_Q"][layer]) for r in recs]
        ax_cq.plot(ep, mean, color=f"C{layer}", label=f"layer {layer + 1}")
        ax_cq.fill_between(ep, lo, hi, color=f"C{layer}", alpha=0.12)
        ax_spread.plot(ep, [h - low for h, low in zip(hi, lo, strict=True)], color=f"C{layer}")
    ax_cq.axhline(THRESHOLD, color="k", ls=":", lw=0.8, label="paper's threshold 0.05")
    ax_cq.set_ylim(0, None)
    ax_cq.set_title("C_Q per layer, seed 0 (mean; band: min-max over heads)", fontsize=9)
    ax_cq.set_xlabel("epoch")
    ax_cq.legend(fontsize=7, ncol=2)
    ax_spread.set_title("C_Q spread within a layer (max - min), seed 0", fontsize=9)
    ax_spread.set_xlabel("epoch")
    for i, (run, stop) in enumerate(zip(runs, stops, strict=True)):
        dev = [e["dev_ppl"] for e in run["epochs"]]
        ax_dev.plot(range(1, len(dev) + 1), dev, color=f"C{i}", label=f"seed {i}")
        for key, marker in (("patience_5", "v"), ("patience_10", "s")):
            ax_dev.plot([stop[key]["stop"]], [dev[stop[key]["stop"] - 1]], marker, color=f"C{i}", mfc="none")
    ax_dev.plot([], [], "v", color="0.3", mfc="none", label="patience 5 stops")
    ax_dev.plot([], [], "s", color="0.3", mfc="none", label="patience 10 stops")
    ax_dev.set_yscale("log")
    ax_dev.set_title("dev perplexity (S-invariant rule never fires: no marker)", fontsize=9)
    ax_dev.set_xlabel("epoch")
    ax_dev.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main(argv=None) -> int:
    with common.quiet():
        return run(argv)


def run(argv=None) -> int:
    args = parse(argv)
    command = common.command_line(__file__, argv)
    device = common.pick_device(args.device)
    common.set_threads(args.threads)
    common.seed_everything(0)
    info = common.machine(device)
    common.print_header("The NN6 paper's protocol, scaled (bench_nn6)", command, info)
    result = {"command": command, "machine": info,
              "settings": {k: v for k, v in vars(args).items() if not isinstance(v, Path)}}  # fmt: skip
    t_start = time.perf_counter()

    arithmetic = paper_arithmetic(pruned=args.prune)
    result["paper_arithmetic"] = arithmetic
    if common.wikitext_file("valid") is None or common.wikitext_file("test") is None:
        print_arithmetic(arithmetic)
        print(f"claims 1-3 skipped: WikiText-2 valid.txt / test.txt not found under {common.WIKITEXT}")
        result["skipped"] = f"WikiText-2 not found under {common.WIKITEXT}"
        common.write_json(args.json, result)
        return 0

    tokenizer, streams, data = load_data(args)
    probe = build(args, len(tokenizer), 0, tokenizer)
    n_params = count_parameters(probe)
    del probe
    print(f"data: {data['split']}")
    print(f"      word-level tokenizer trained on the training text, {data['vocab']:,} tokens"
          f"{' (most frequent words; others -> [UNK])' if args.vocab else ''}; tokens used: train "
          f"{data['tokens']['train']:,} per epoch (of {data['tokens_available']['train']:,}), dev "
          f"{data['tokens']['dev']:,}, test {data['tokens']['test']:,} (of {data['tokens_available']['test']:,}); "
          f"[UNK] rate test {data['unk_rate']['test']:.1%}")  # fmt: skip
    print(f"model: GPT-2, {args.layers} layers x {args.heads} heads, d_model {args.d_model} (d_head "
          f"{args.d_model // args.heads}), n_inner {4 * args.d_model}, tied lm_head, {n_params:,} "
          f"parameters")  # fmt: skip
    print(f"training: {args.epochs} epochs of {args.batch} x {args.seq_len}-token blocks, AdamW lr {args.lr:g} "
          f"(1-epoch linear warm-up, then constant), betas (0.9, 0.95), weight decay {args.weight_decay:g}, "
          f"dropout {args.dropout:g}, clip 1.0; seeds 0-{args.seeds - 1}; measures at init and every "
          f"epoch end")  # fmt: skip
    print("perplexity: non-overlapping windows of the block length over the whole dev / capped test stream")
    print(flush=True)

    runs, stops, stats, prunes = [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            common.seed_everything(seed)
            run = train_run(args, seed, streams, tokenizer, device, Path(tmp) / f"trace{seed}.jsonl")
            dev = [e["dev_ppl"] for e in run["epochs"]]
            cache: dict[int, float] = {}
            stop = {"budget": {"stop": args.epochs, "restored": args.epochs}}
            for p in (5, 10):
                at, best = patience_stop(dev, p)
                stop[f"patience_{p}"] = {"stop": at, "restored": best}
            fired = sinv_stop(run["records"])
            stop["sinv"] = {"stop": fired or args.epochs, "restored": fired or args.epochs, "fired": fired is not None}
            best_all = min(range(1, len(dev) + 1), key=lambda e: dev[e - 1])
            stop["best_dev"] = {"stop": args.epochs, "restored": best_all}
            for rule in stop.values():
                rule["test_ppl"] = test_ppl_at(run, rule["restored"], streams, args, device, cache)
                rule["dev_ppl"] = dev[rule["restored"] - 1]
            st = head_stats(run["records"], args.sinv_epochs)
            closest = min((e["rule_max"], e["epoch"]) for e in run["epochs"])
            st["rule_max_min"] = {"value": closest[0], "epoch": closest[1]}
            arms = prune_arms(run, best_all, streams, tokenizer, args, device, seed)
            base_ppl = stop["best_dev"]["test_ppl"]
            runs.append(run)
            stops.append(stop)
            stats.append(st)
            prunes.append({"base_test_ppl": base_ppl, "best_epoch": best_all, "arms": arms})
            secs = sum(e["seconds"] for e in run["epochs"])
            print(f"seed {seed}: {args.epochs} epochs in {secs:.0f} s; best dev ppl {dev[best_all - 1]:.2f} at epoch "
                  f"{best_all} (test {base_ppl:.2f}); final dev {dev[-1]:.2f}; lowest C_Q {st['lowest']['C_Q']:.3f} "
                  f"(layer {st['lowest']['layer'] + 1}, epoch {st['lowest']['epoch']:g}); heads < 0.05: "
                  f"{st['crossed']}; S-invariant rule {'fired at ' + str(fired) if fired else 'never fired'}",
                  flush=True)  # fmt: skip
        for run in runs:  # the models are not needed after this point
            run.pop("model")
            run.pop("states")

    print()
    report(args, stats, stops, prunes, data)
    print_arithmetic(arithmetic)
    elapsed = time.perf_counter() - t_start
    common.finish(info)
    print(f"elapsed {elapsed:.0f} s")
    result.update({"data": data, "parameters": n_params, "stopping": stops, "head_stats": stats, "pruning": prunes,
                   "runs": [{"epochs": r["epochs"], "C_Q": [rec["C_Q"] for rec in r["records"]]} for r in runs],
                   "elapsed_s": round(elapsed, 1)})  # fmt: skip
    if args.plot:
        plot(args.plot, runs, stops, f"GPT-2 {args.layers}x{args.heads}, d_model {args.d_model}, trained from scratch "
             f"on WikiText-2 valid.txt ({args.seeds} seeds)")  # fmt: skip
        result["plot"] = str(args.plot)
    common.write_json(args.json, result)
    return 0


def ms(values, digits=2) -> str:
    return common.fmt_ms(values, digits)


def report(args, stats, stops, prunes, data) -> None:
    n = len(stats)
    # Claim 1: heads below 0.05.
    crossed = [s["crossed"] for s in stats]
    lowest = ", ".join(f"{s['lowest']['C_Q']:.3f}" for s in stats)
    closest = ", ".join(f"{s['rule_max_min']['value']:.3f}" for s in stats)
    print(f"Claim 1: heads reach C_Q < 0.05 -- heads below 0.05 at any epoch, per seed: {crossed}; lowest C_Q "
          f"of any head at any epoch, per seed: {lowest}; smallest 'largest measure' the stopping rule saw: "
          f"{closest}")  # fmt: skip
    w = stats[0]["window_epoch"]
    rows = []
    for layer in range(len(stats[0]["layers"])):
        per = [s["layers"][layer] for s in stats]
        rows.append([f"{layer + 1}", ms([p["init_mean"] for p in per], 3), ms([p["window_mean"] for p in per], 3),
                     ms([p["final_mean"] for p in per], 3), ms([p["init_spread"] for p in per], 3),
                     ms([p["final_max"] - p["final_min"] for p in per], 3),
                     f"{min(p['lowest'] for p in per):.3f}", f"{sum(p['crossed'] for p in per)}"])  # fmt: skip
    print(common.table(["layer", "C_Q mean, init", f"C_Q mean, epoch {w:g}", f"C_Q mean, epoch {args.epochs}",
                        "spread, init", f"spread, epoch {args.epochs}", "lowest (any head, epoch, seed)",
                        "heads < 0.05"], rows, "lrrrrrrr"))  # fmt: skip
    print(f"(mean ± std over {n} seeds of each layer's mean over its {args.heads} heads; spread = max - min over "
          f"the layer's heads)")  # fmt: skip
    print()
    # Claim 2: stopping rules.
    names = [("sinv", "S-invariant rule (all C < 0.05)", PAPER["stop_sinv"]),
             ("patience_5", "early stopping, patience 5", PAPER["patience_5"]),
             ("patience_10", "early stopping, patience 10", PAPER["patience_10"]),
             ("budget", f"no rule: all {args.epochs} epochs", "-")]  # fmt: skip
    rows = []
    for key, label, paper in names:
        fired = [s[key].get("fired", True) for s in stops]
        note = "" if all(fired) else f" (never fired: ran to the budget in {fired.count(False)}/{n})"
        rows.append([label + note, ms([s[key]["stop"] for s in stops], 1),
                     ms([s[key]["restored"] for s in stops], 1), ms([s[key]["dev_ppl"] for s in stops]),
                     ms([s[key]["test_ppl"] for s in stops]), paper])  # fmt: skip
    print("Claim 2: stopping rules, applied to the same runs (early stopping restores its best dev epoch):")
    print(common.table(["rule", "epochs trained", "weights of epoch", "dev ppl", "test ppl",
                        "paper (val ppl, full scale)"], rows, "lrrrrr"))  # fmt: skip
    print(f"(mean ± std over {n} seeds; dev = last {args.dev_fraction:.0%} of valid.txt; test = first "
          f"{data['tokens']['test']:,} tokens of test.txt)")  # fmt: skip
    print()
    # Claim 3: pruning.
    rows = []
    base = [p["base_test_ppl"] for p in prunes]
    params = prunes[0]["arms"][0]["params_before"]
    rows.append(["none (best-dev checkpoint)", "0", f"{params:,}", ms(base), "-", PAPER["prune"]["none"]])
    for name in ("sinv_early", "random", "magnitude", "taylor"):
        arms = [a for p in prunes for a in p["arms"] if a["criterion"] == name]
        deltas = [a["test_ppl"] - p["base_test_ppl"] for p in prunes for a in p["arms"] if a["criterion"] == name]
        after = sorted({a["params_after"] for a in arms})
        label = name + (f" ({args.random_prune_seeds} seeds x {n} runs)" if name == "random" else "")
        if name == "sinv_early":
            crossed = [a["crossed"] for a in arms]
            label += f" ({sum(crossed)} of {len(crossed) * args.heads * args.layers} heads crossed 0.05)"
        rows.append([label, f"{arms[0]['removed']}", ", ".join(f"{a:,}" for a in after),
                     ms([a["test_ppl"] for a in arms]), ms(deltas), PAPER["prune"][name]])  # fmt: skip
    print(f"Claim 3: pruning {args.prune} of {args.layers * args.heads} heads "
          f"({args.prune / (args.layers * args.heads):.1%}) from the best-dev checkpoint, no fine-tune:")  # fmt: skip
    print(common.table(["criterion", "heads removed", "parameters after", "test ppl", "change vs unpruned",
                        "paper (ppl)"], rows, "lrrrrr"))  # fmt: skip
    share = (params - prunes[0]["arms"][0]["params_after"]) / params
    print(f"(mean ± std over {n} training seeds; {args.prune} heads are {share:.2%} of the {params:,} parameters here; "
          f"the paper claims 15%)")  # fmt: skip
    print()


if __name__ == "__main__":
    sys.exit(main())
