"""Peak memory beyond the model of shrink, OBS compensation and REAP expert selection, at growing depth.

Random-initialised models of one width at ``--layers`` depths (default 4, 8, 16): a LLaMA shape for
``shrink`` (``--budget`` plans, ``--calib-sequences`` x ``--seq-len`` random tokens) and for
``prune(..., compensate="obs")`` (a quarter of every layer's MLP channels and one query head per KV group),
and a Qwen3-MoE shape of the same width for ``reap`` expert selection (a quarter of every layer's experts,
``Pruner([Part("experts", "reap", 0.25)])``). Each measurement runs in a fresh subprocess so that peaks do not
mix: the child builds the model, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``; without it,
``ru_maxrss`` and the RSS right after the build), runs the tool and reports its peak host RSS minus the RSS
right after the build (and, on CUDA, ``torch.cuda.max_memory_allocated`` minus the memory allocated once the
model is on the device). One table: rows tool x depth; columns the model's size, the peak overhead, its
growth over the shallowest depth, the time, and the overhead the memory model
(:mod:`sinv_prune.pipeline.memory_model`, where installed) predicts for the same run.

``--only large``: a LLaMA-3-8B shape (hidden 4096, intermediate 14336, 32 / 8 heads, a small vocabulary) in
bfloat16 shrunk with ``--offload`` (passed only where the installed ``shrink`` takes ``offload=``), and a
Qwen3-30B-A3B shape (hidden 2048, 128 experts of 768, top-8, 32 / 4 heads, ``--large-moe-layers`` layers)
cut by REAP in bfloat16. Before each row the script prints what it expects the row to take (from the rows
already measured, scaled by the parameter count), and at the end the total and, per tool, what 32 layers of
the measured width would take (a line through the measured depths; the width is not extrapolated, the OBS
solves being cubic in it).

    nice -n 10 python scripts/bench_memory.py --threads 1                 # the small table
    python scripts/bench_memory.py --only large --device cuda --offload none
    python scripts/bench_memory.py --quick                                  # tiny widths: tests the script
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _bench_common as common  # noqa: E402

MIB = 1 << 20
TOOLS = ("shrink", "obs", "reap")

#: name -> (family, config keywords); ``layers`` set per row. The vocabulary is small on purpose: the
#: embedding and head are not what the tools' memory depends on.
SMALL = {"hidden": 512, "intermediate": 2048, "heads": 8, "kv_heads": 2, "experts": 8, "top_k": 2}
QUICK = {"hidden": 64, "intermediate": 128, "heads": 4, "kv_heads": 2, "experts": 4, "top_k": 2}
LLAMA_8B = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 2048}
QWEN3_30B_A3B = {"hidden": 2048, "expert_intermediate": 768, "heads": 32, "kv_heads": 4, "head_dim": 128,
                 "experts": 128, "top_k": 8, "vocab": 2048}  # fmt: skip


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)  # fmt: skip
    ap.add_argument("--only", choices=("small", "large"), default="small", help="which shapes (default small)")
    ap.add_argument("--large", action="store_true", help="the same as --only large")
    ap.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    ap.add_argument("--layers", nargs="+", type=int, default=[4, 8, 16], help="depths of the small shapes")
    ap.add_argument("--hidden", type=int, help=f"small shapes' hidden width (default {SMALL['hidden']})")
    ap.add_argument("--intermediate", type=int, help=f"small LLaMA's MLP width (default {SMALL['intermediate']})")
    ap.add_argument("--heads", type=int, help=f"query heads (default {SMALL['heads']})")
    ap.add_argument("--kv-heads", type=int, help=f"key/value heads (default {SMALL['kv_heads']})")
    ap.add_argument("--experts", type=int, help=f"small MoE's routed experts (default {SMALL['experts']})")
    ap.add_argument("--vocab", type=int, default=1024, help="vocabulary of the small shapes")
    ap.add_argument("--calib-sequences", type=int, default=8, help="calibration sequences")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sequence")
    ap.add_argument("--budget", type=int, default=4, help="shrink's search budget (plans evaluated)")
    ap.add_argument("--cut", type=float, default=0.25, help="shrink's share of non-embedding parameters")
    ap.add_argument("--large-layers", type=int, default=32, help="layers of the LLaMA-3-8B shape (32: the real one)")
    ap.add_argument("--large-moe-layers", type=int, default=4, help="layers of the Qwen3-30B-A3B shape (48 real)")
    ap.add_argument("--offload", choices=("none", "cpu", "disk"), default=None,
                    help="shrink(offload=...) where the installed shrink takes it (default: disk with --only large "
                         "on the CPU, none otherwise)")  # fmt: skip
    ap.add_argument(
        "--store",
        choices=("cpu", "disk"),
        default="cpu",
        help="store= of shrink and prune (where the per-layer statistics and prune's rollback copies wait)",
    )
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default float32 (small), bfloat16 (large)")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="tiny widths, 1 and 2 layers: tests the script only")
    ap.add_argument("--json", help="write every result here")
    ap.add_argument("--table-from", help="print the table of an earlier --json run, with today's predictions")
    ap.add_argument("--child", help=argparse.SUPPRESS)  # one measurement, its spec as JSON
    args = ap.parse_args(argv)
    if args.large:
        args.only = "large"
    base = QUICK if args.quick else SMALL
    for key in ("hidden", "intermediate", "heads", "kv_heads", "experts"):
        if getattr(args, key) is None:
            setattr(args, key, base[key])
    if args.quick:
        args.layers = [1, 2] if args.layers == [4, 8, 16] else args.layers
        args.calib_sequences, args.seq_len, args.vocab = min(args.calib_sequences, 4), min(args.seq_len, 16), 128
    if args.dtype is None:
        args.dtype = "bfloat16" if args.only == "large" else "float32"
    return args


# -- the child: one measurement ----------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark (VmHWM) of this process; False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def config_of(spec: dict):
    """``(config, model class)`` of the spec's random model (``family`` llama or qwen3_moe)."""
    import transformers

    common_kw = dict(vocab_size=spec["vocab"], hidden_size=spec["hidden"], num_hidden_layers=spec["layers"],
                     num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                     max_position_embeddings=max(spec["seq_len"], 512), bos_token_id=0, eos_token_id=0,
                     tie_word_embeddings=False)  # fmt: skip
    if spec.get("head_dim"):
        common_kw["head_dim"] = spec["head_dim"]
    if spec["family"] == "llama":
        config = transformers.LlamaConfig(intermediate_size=spec["intermediate"], **common_kw)
        cls = transformers.LlamaForCausalLM
    else:
        config = transformers.Qwen3MoeConfig(intermediate_size=spec["expert_intermediate"],
                                             moe_intermediate_size=spec["expert_intermediate"],
                                             num_experts=spec["experts"], num_experts_per_tok=spec["top_k"],
                                             decoder_sparse_step=1, mlp_only_layers=[], **common_kw)  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    config._attn_implementation = "sdpa"
    return config, cls


def build(spec: dict):
    """The random model of ``spec``, eval mode, in ``spec['dtype']``."""
    import torch

    family, dtype = spec["family"], getattr(torch, spec["dtype"])
    config, cls = config_of(spec)
    torch.manual_seed(spec["seed"])
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # built in the target dtype: no float32 copy of an 8B model first
    # on CUDA without offload built there (an 8B shape's random init takes minutes on the CPU)
    where = spec["device"] if spec["device"].startswith("cuda") and spec.get("offload") == "none" else "cpu"
    try:
        with torch.device(where):
            model = cls(config).eval()
    finally:
        torch.set_default_dtype(previous)
    if family == "qwen3_moe":  # routers of a random init pick almost uniformly; wider logits route unevenly
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0, 0.3)
    return model


def _calibration(spec: dict):
    import torch

    g = torch.Generator().manual_seed(spec["seed"] + 1)
    return [torch.randint(1, spec["vocab"], (spec["seq_len"],), generator=g) for _ in range(spec["sequences"])]


def _obs_plan(model) -> dict:
    """A quarter of every layer's MLP channels (every fourth) and query head 0 of every KV group."""
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    heads = list(range(0, cfg.num_attention_heads, group)) if group > 1 else []
    plan = {"mlp": {i: list(range(0, cfg.intermediate_size, 4)) for i in range(cfg.num_hidden_layers)}}
    if heads:
        plan["heads"] = {i: heads for i in range(cfg.num_hidden_layers)}
    return plan


def run_tool(model, spec: dict) -> dict:
    """Run ``spec['tool']`` on ``model`` in place; returns what it reports worth keeping."""
    import sinv_prune
    from sinv_prune.scoring.pruner import Part, Pruner

    seqs = _calibration(spec)
    tool = spec["tool"]
    if tool == "shrink":
        kwargs = {"store": spec["store"]} if takes("store", sinv_prune.shrink) else {}
        if spec.get("offload", "none") != "none" and offload_supported():
            kwargs["offload"] = spec["offload"]
        found = sinv_prune.shrink(model, spec["cut"], calibration=seqs, sequences=len(seqs), length=spec["seq_len"],
                                  budget=spec["budget"], seed=spec["seed"], quiet=True, **kwargs)  # fmt: skip
        return {"removed": found.removed, "offload": kwargs.get("offload", "not supported")}
    if tool == "obs":
        batches = [{"input_ids": s.view(1, -1)} for s in seqs]
        store = {"store": spec["store"]} if takes("store", sinv_prune.prune) else {}
        summary = sinv_prune.prune(model, _obs_plan(model), calibration=batches, compensate="obs", **store)
        return {"removed": summary.params_removed if hasattr(summary, "params_removed") else None}
    batches = [{"input_ids": s.view(1, -1)} for s in seqs]
    store = {"store": spec["store"]} if takes("store", Pruner) else {}
    pruner = Pruner([Part("experts", "reap", 0.25)], **store)
    pruner.prune(model, batches=batches)
    return {"removed_experts": sum(len(v) for v in pruner.last_selection["experts"].values())}


def child(spec: dict) -> dict:
    import torch

    import sinv_prune  # noqa: F401  (imported before the baseline: its import is not the tool's memory)

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = spec["device"]
    model = build(spec)
    model_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    cuda = device.startswith("cuda")
    if cuda and spec.get("offload", "none") in (None, "none"):
        model.to(device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        cuda_base = torch.cuda.memory_allocated()
    import gc

    gc.collect()
    reset = _reset_peak()
    rss_base = _status_kib("VmRSS") * 1024
    maxrss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    info = run_tool(model, spec)
    seconds = time.perf_counter() - start
    # ru_maxrss never resets: it is right only where the build's own peak stayed below the tool's
    peak = _status_kib("VmHWM") * 1024 if reset else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {"model_bytes": model_bytes, "rss_base": rss_base, "peak_rss": peak, "host_overhead": peak - rss_base,
           "seconds": seconds, "peak_mark": "VmHWM reset" if reset else "ru_maxrss",
           "maxrss_before": maxrss_before, **info}  # fmt: skip
    if cuda:
        torch.cuda.synchronize()
        out["cuda_overhead"] = torch.cuda.max_memory_allocated() - cuda_base
    return out


# -- the parent ----------------------------------------------------------------------------------


def specs(args) -> list[dict]:
    """One spec per row, in the order they run."""
    shared = {"seq_len": args.seq_len, "sequences": args.calib_sequences, "budget": args.budget, "cut": args.cut,
              "seed": args.seed, "device": common.pick_device(args.device), "threads": args.threads,
              "dtype": args.dtype, "store": args.store}  # fmt: skip
    out = []
    if args.only == "small":
        dense = {"family": "llama", "hidden": args.hidden, "intermediate": args.intermediate, "heads": args.heads,
                 "kv_heads": args.kv_heads, "vocab": args.vocab}  # fmt: skip
        moe = {"family": "qwen3_moe", "hidden": args.hidden, "expert_intermediate": max(8, args.intermediate // 4),
               "heads": args.heads, "kv_heads": args.kv_heads, "experts": args.experts,
               "top_k": min(SMALL["top_k"], args.experts), "vocab": args.vocab}  # fmt: skip
        for tool in args.tools:
            for layers in args.layers:
                shape = moe if tool == "reap" else dense
                out.append({**shared, **shape, "tool": tool, "layers": layers, "shape": f"{shape['family']}"})
        offload = args.offload or "none"
    else:
        offload = args.offload or ("none" if shared["device"].startswith("cuda") else "disk")
        if "shrink" in args.tools or "obs" in args.tools:
            dense = {"family": "llama", **LLAMA_8B, "layers": args.large_layers, "shape": "LLaMA-3-8B shape"}
            out.append({**shared, **dense, "tool": "shrink"})
        if "reap" in args.tools:
            moe = {"family": "qwen3_moe", **QWEN3_30B_A3B, "layers": args.large_moe_layers,
                   "shape": "Qwen3-30B-A3B shape"}  # fmt: skip
            out.append({**shared, **moe, "tool": "reap"})
    if offload != "none" and not offload_supported():
        print(f"note: the installed shrink takes no offload=; --offload {offload} is not applied (rows run as none)")
        offload = "none"
    for s in out:
        s["offload"] = offload
    return out


def takes(name: str, fn) -> bool:
    """Whether ``fn`` has a keyword argument ``name`` (older code runs without it)."""
    import inspect

    return name in inspect.signature(fn).parameters


def offload_supported() -> bool:
    """Whether the installed :func:`sinv_prune.shrink` takes ``offload=``."""
    import sinv_prune

    return "offload" in inspect.signature(sinv_prune.shrink).parameters


def parameter_count(spec: dict) -> int:
    """Parameters of the spec's model, from its shape (for the time projection)."""
    h, heads, kv = spec["hidden"], spec["heads"], spec["kv_heads"]
    d = spec.get("head_dim") or h // heads
    attn = h * d * (2 * heads + 2 * kv)
    mlp = (
        3 * h * spec["intermediate"]
        if spec["family"] == "llama"
        else 3 * h * spec["expert_intermediate"] * spec["experts"]
    )
    return spec["layers"] * (attn + mlp) + 2 * spec["vocab"] * h


def predicted(spec: dict) -> dict | None:
    """The memory model's overheads for the row (bytes beyond the model), layer-wise and whole-model designs;
    None where :mod:`sinv_prune.pipeline.memory_model` is not installed."""
    if os.environ.get("SINV_PRUNE_BENCH_NO_PREDICTION"):
        return None
    try:
        from sinv_prune.pipeline import memory_model
    except ImportError:
        return None
    config, cls = config_of(spec)
    shape = memory_model.shape_of(config, cls, spec["dtype"])
    task = {"shrink": "shrink", "obs": "compensate", "reap": "criterion"}[spec["tool"]]
    held = max(1, spec["sequences"] // 8)  # shrink's held-out share (1/8); its fitness batch: 4 of them, <= 256 tokens
    options = dict(sequences=spec["sequences"], length=spec["seq_len"], device=spec["device"],
                   offload=spec.get("offload") or "none",
                   fitness_tokens=min(held, 4) * min(256, spec["seq_len"]),
                   kept_share=1 - spec["cut"] if spec["tool"] == "shrink" else 0.75)  # fmt: skip
    if "store" in inspect.signature(memory_model.predict).parameters and spec["tool"] == "shrink":
        options["store"] = spec.get("store") or "cpu"
    out = {}
    for design, layerwise in (("layerwise", True), ("whole", False)):
        pred = memory_model.predict(shape, task, layerwise=layerwise, **options)
        out[design] = {"device_overhead": pred.device_overhead, "host_overhead": pred.host_overhead,
                       "device_peak": pred.device_peak, "host_peak": pred.host_peak}  # fmt: skip
    return out


def measure(spec: dict) -> dict:
    """Run one spec in a fresh process; its result (or the error it ended with).

    On the CPU a forked child (the imports are done once, ~1 min of a loaded 2-core machine each); on CUDA, where
    a fork after the driver is up is unsafe, a fresh interpreter.
    """
    if spec["device"] == "cpu" and hasattr(os, "fork"):
        return _forked(spec)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [f"exit {done.returncode}"]
        return {"error": f"exit {done.returncode}: {tail[0]}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _forked(spec: dict) -> dict:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, write the JSON, leave without running the parent's exit handlers
        os.close(read)
        code = 0
        try:
            payload = json.dumps(child(spec))
        except BaseException as err:  # noqa: BLE001  (reported to the parent as the row's error)
            payload, code = (
                json.dumps({"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}),
                1,
            )
        with os.fdopen(write, "w") as f:
            f.write(payload)
        os._exit(code)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    _, status = os.waitpid(pid, 0)
    if not text:
        return {"error": f"the child ended with status {status} (killed for memory?)"}
    return json.loads(text)


def _mib(x) -> str:
    return "-" if x is None else f"{x / MIB:,.0f}"


def main(argv=None) -> int:
    args = parse(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    if args.table_from:
        saved = json.loads(Path(args.table_from).read_text())
        rows = [{**r, "predicted": predicted(r["spec"])} for r in saved["rows"]]
        print(f"$ {saved['command']}\n")
        print(render(rows))
        for line in projections(rows):
            print(line)
        return 0
    command = common.command_line("scripts/bench_memory.py", argv)
    common.set_threads(args.threads)
    device = common.pick_device(args.device)
    info = common.machine(device)
    common.print_header("peak memory beyond the model: shrink, OBS compensation, REAP", command, info)
    rows = specs(args)
    print(f"{len(rows)} rows, {args.calib_sequences} x {args.seq_len} calibration tokens, {args.dtype}, "
          f"shrink budget {args.budget}, offload {rows[0]['offload'] if rows else '-'}, store {args.store}; "
          "each row in its own process", flush=True)  # fmt: skip
    results, rate = [], {}  # rate: seconds per parameter of each tool, from the rows measured so far
    for spec in rows:
        params = parameter_count(spec)
        guess = f", expected ~{rate[spec['tool']] * params:.0f} s" if spec["tool"] in rate else ""
        print(f"  {spec['tool']} {spec['shape']} {spec['layers']} layers ({params / 1e6:,.0f}M parameters){guess} ...",
              flush=True)  # fmt: skip
        t = time.perf_counter()
        got = measure(spec)
        wall = time.perf_counter() - t
        row = {"spec": spec, **got, "wall_s": round(wall, 1), "predicted": predicted(spec)}
        if "error" not in got:
            rate[spec["tool"]] = got["seconds"] / params
            print(f"    overhead {_mib(got['host_overhead'])} MiB host"
                  + (f", {_mib(got['cuda_overhead'])} MiB CUDA" if "cuda_overhead" in got else "")
                  + f", {got['seconds']:.1f} s", flush=True)  # fmt: skip
        else:
            print(f"    failed: {got['error']}", flush=True)
        results.append(row)
    print()
    print(render(results))
    total = sum(r["wall_s"] for r in results)
    print(f"\ntotal {total:.0f} s ({total / 60:.1f} min) for {len(results)} rows")
    for line in projections(results):
        print(line)
    common.finish(info)
    common.write_json(args.json, {"command": command, "machine": info, "settings": vars(args), "rows": results})
    return 0 if all("error" not in r for r in results) else 1


def projections(results: list[dict], depth: int = 32) -> list[str]:
    """Per tool, the time a ``depth``-layer model of the measured width would take: a line through the measured
    (layers, seconds) points (least squares). The width is not extrapolated: the OBS solves are cubic in it."""
    lines = []
    for tool in TOOLS:
        points = [(r["spec"]["layers"], r["seconds"]) for r in results if r["spec"]["tool"] == tool and "seconds" in r]
        if len({x for x, _ in points}) < 2:
            continue
        mx = sum(x for x, _ in points) / len(points)
        my = sum(y for _, y in points) / len(points)
        slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
        at = my + slope * (depth - mx)
        lines.append(
            f"{tool}: {slope:.1f} s a layer here; {depth} layers of this width: ~{at:.0f} s ({at / 60:.0f} min)"
        )
    return lines


def render(results: list[dict]) -> str:
    """The table: tool x depth, model size, overheads, growth over the tool's first depth, time, prediction."""
    cuda = any("cuda_overhead" in r for r in results)
    first: dict[tuple, float] = {}
    lines = []
    for r in results:
        s = r["spec"]
        key = (s["tool"], s["shape"])
        name = {"shrink": "shrink", "obs": "prune obs", "reap": "reap experts"}[s["tool"]]
        if "error" in r:
            lines.append([f"{name} ({s['shape']})", s["layers"], "-", "failed", "", "", r["error"][:60]])
            continue
        measured = r["cuda_overhead"] if cuda else r["host_overhead"]
        first.setdefault(key, measured)
        growth = f"{100 * (measured / first[key] - 1):+.0f}%" if first[key] > 0 else "-"
        pred = r.get("predicted") or {}
        field = "device_overhead" if cuda else "host_overhead"
        row = [f"{name} ({s['shape']})", s["layers"], _mib(r["model_bytes"]), _mib(r["host_overhead"])]
        if cuda:
            row.append(_mib(r["cuda_overhead"]))
        row += [growth, f"{r['seconds']:.1f}"]
        for design in ("layerwise", "whole"):
            value = (pred.get(design) or {}).get(field)
            ratio = f" ({value / measured:.2f}x)" if value and measured > 0 else ""
            row.append(_mib(value) + ratio)
        lines.append(row)
    headers = ["tool (shape)", "layers", "model MiB", "peak host overhead MiB"]
    if cuda:
        headers.append("peak CUDA overhead MiB")
    headers += ["overhead growth vs first depth", "time s", "predicted: layer-wise", "predicted: whole-model"]
    lines = [ln if len(ln) == len(headers) else ln + [""] * (len(headers) - len(ln)) for ln in lines]
    return common.table(headers, lines)


if __name__ == "__main__":
    sys.exit(main())
