"""The model card (``README.md``) pushed with a pruned checkpoint.

``model_card`` writes Hub metadata (``library_name``, ``base_model``, ``tags``,
``pipeline_tag``) and says what was removed (per layer, original numbering) and by
which criterion, parameters and perplexity before and after (on what data, by what
method), the recipe, how to load the checkpoint and the library versions. It uses a
run's ``results.json`` and ``recipe.yaml`` where there is a run; for a plain
checkpoint directory it says what the pruning record in ``config.json`` can tell.
"""

from __future__ import annotations

import re
from typing import Any

import transformers
import yaml
from huggingface_hub import ModelCardData
from transformers.models.auto import modeling_auto

from sinv_prune.lmeval.report import pins_text, task_cell, task_header, task_names, task_pins
from sinv_prune.surgery.checkpoint import AUTO_MAPPINGS, PREFIX
from sinv_prune.surgery.record import get_record
from sinv_prune.units import units
from sinv_prune.units.heads import HEADS
from sinv_prune.version import __version__

TAGS = ["sinv-prune", "pruned", "attention-head-pruning"]
PIPELINE_TAGS = {
    "AutoModelForCausalLM": "text-generation",
    "AutoModelForMaskedLM": "fill-mask",
    "AutoModelForSequenceClassification": "text-classification",
    "AutoModelForTokenClassification": "token-classification",
    "AutoModelForQuestionAnswering": "question-answering",
    "AutoModel": "feature-extraction",
}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
STAGE_WORDS = {"pruned": "pruned, not fine-tuned", "finetuned": "pruned, then fine-tuned"}


def auto_class_name(config, class_name: str | None) -> str:
    """The ``AutoModel*`` class that maps ``config.model_type`` to ``class_name`` (``AutoModel`` otherwise)."""
    for auto, mapping_name in AUTO_MAPPINGS.items():
        name = getattr(modeling_auto, mapping_name, {}).get(config.model_type)
        names = name if isinstance(name, (list, tuple)) else [name]
        if class_name in names and auto != "AutoModelForPreTraining":
            return auto
    return "AutoModel"


def base_model_id(recipe: dict | None) -> str | None:
    """The recipe's ``model.path`` when it names a Hub model (``owner/name``), else None."""
    path = ((recipe or {}).get("model") or {}).get("path")
    if isinstance(path, str) and HUB_ID.fullmatch(path) and not path.startswith((".", "~")):
        return path
    return None


def find_arm(results: dict | None, arm: str | None) -> dict | None:
    """The ``results["arms"]`` row named ``arm`` (or the only row when ``arm`` is None)."""
    rows = (results or {}).get("arms") or []
    if arm is None:
        return rows[0] if len(rows) == 1 else None
    return next((row for row in rows if row.get("name") == arm), None)


def model_card(
    config,
    *,
    repo_id: str,
    results: dict | None = None,
    arm: str | None = None,
    stage: str | None = None,
    recipe_text: str | None = None,
    params: int | None = None,
    params_before: int | None = None,
    has_tokenizer: bool = False,
    gguf: list | None = None,
) -> str:
    """``README.md`` text for the checkpoint whose config is ``config``, pushed to ``repo_id``.

    ``results`` is a run's ``results.json`` content and ``arm`` the arm's name in it;
    ``stage`` is ``"pruned"`` or ``"finetuned"`` (which of the arm's models this is;
    default: fine-tuned when the arm was). ``recipe_text`` is the resolved recipe YAML.
    ``params`` / ``params_before`` are used where ``results`` has no counts. ``gguf``: the GGUF
    files pushed with the checkpoint (``GGUFFile`` items of :func:`sinv_prune.hub.gguf_files.gguf_files`), each named
    with its type and the commands that run it in a "Use with llama.cpp" section.
    """
    record = get_record(config)
    recipe = _parse_yaml(recipe_text)
    row = find_arm(results, arm)
    stage = stage or ("finetuned" if row and row.get("finetuned") else "pruned")
    base_class = record.base_class if record else (config.architectures or [None])[0] or config.model_type
    auto = auto_class_name(config, base_class)
    base_id = base_model_id(recipe)
    tags = list(TAGS) if record else ["sinv-prune"]
    data = ModelCardData(
        library_name="transformers",
        base_model=base_id,
        tags=tags,
        pipeline_tag=PIPELINE_TAGS.get(auto),
        datasets=_datasets(recipe),
    )
    name = repo_id.split("/")[-1]
    baseline = (results or {}).get("baseline") or {}
    after = (row or {}).get(stage) or {}
    params = after.get("params", params)
    params_before = baseline.get("params", params_before)

    lines = ["---", data.to_yaml().strip(), "---", "", f"# {name}", ""]
    lines += _summary(config, record, base_class, base_id, recipe, row, stage, params, params_before)
    if record is not None:
        lines += _removed_table(record)
    lines += _evaluation(results, row, stage, recipe, baseline, after, pushed_gguf=bool(gguf))
    lines += _how_to_load(repo_id, record, auto, has_tokenizer)
    lines += _llama_cpp(repo_id, gguf or [])
    if recipe_text:
        fence = "`" * max(3, _longest_backtick_run(recipe_text) + 1)
        lines += ["## Recipe", "", "The resolved recipe of the run (`sinv-prune RECIPE.yaml` reproduces it):", "",
                  f"{fence}yaml", recipe_text.rstrip(), fence, ""]  # fmt: skip
    lines += _provenance(record, results, arm)
    return "\n".join(lines).rstrip() + "\n"


# -- sections -----------------------------------------------------------------------------------


def _summary(config, record, base_class, base_id, recipe, row, stage, params, params_before) -> list[str]:
    if record is None:
        return [f"A `{base_class}` checkpoint pushed with sinv_prune {__version__}. It was **not pruned**: "
                "its config has no sinv_prune pruning record.", ""]  # fmt: skip
    heads = HEADS.recorded(record)  # the card's headline: attention heads, whatever else went
    removed = sum(len(v) for v in heads.values())
    total = record.num_layers * record.num_heads
    lines = [
        f"{_base_phrase(base_class, base_id, recipe)} with **{removed} of its {total} attention heads removed** "
        f"({100 * removed / total:.1f}%) by `sinv_prune`. The heads are "
        "physically gone (the Q/K/V/O weight matrices are smaller), not masked.",
        "",
    ]
    if row:
        options = row.get("options") or {}
        criterion = f"`{row.get('criterion')}`" + (f" (options {options})" if options else "")
        lines.append(f"- **Criterion:** {criterion}; amount {row.get('amount')}, mode `{row.get('mode')}`, "
                     f"arm `{row.get('name')}`.")  # fmt: skip
        lines.append(f"- **This checkpoint:** {STAGE_WORDS.get(stage, stage)}.")
    else:
        lines.append("- **Criterion:** not recorded (pushed from a checkpoint directory without its run's results).")
    if params is not None and params_before:
        change = 100 * (params - params_before) / params_before
        lines.append(f"- **Parameters:** {params_before:,} before, {params:,} after ({change:+.2f}%).")
    elif params is not None:
        lines.append(f"- **Parameters:** {params:,} after pruning.")
    kept = sorted({record.num_heads - len(heads.get(i, [])) for i in range(record.num_layers)})
    per_layer = f"{kept[0]}" if len(kept) == 1 else f"{kept[0]} to {kept[-1]}"
    kv = f", {record.num_kv_heads} KV heads originally" if record.num_kv_heads != record.num_heads else ""
    lines.append(f"- **Shape:** {record.num_layers} layers, {per_layer} of {record.num_heads} heads kept per layer "
                 f"(head dim {record.head_dim}{kv}).")  # fmt: skip
    others = [kind for kind in units() if kind.card_label and kind.applies(record)]  # beside the headline
    if any(kind.recorded(record) for kind in others):
        labels = [kind.card_label for kind in others]
        label = " and ".join([", ".join(labels[:-1]), labels[-1]]) if len(labels) > 1 else labels[0]
        lines.append(f"- **{label}:** " + "; ".join(kind.card_text(record) for kind in others) + ".")
    return lines + [""]


def _base_phrase(base_class: str, base_id: str | None, recipe: dict | None) -> str:
    model = (recipe or {}).get("model") or {}
    if base_id:
        gguf = f" (GGUF file `{model['gguf_file']}`, dequantized)" if model.get("gguf_file") else ""
        return f"[{base_id}](https://huggingface.co/{base_id}){gguf}"
    if model.get("architecture"):
        return f"A `{base_class}` trained from scratch by the recipe below ({model['architecture']} architecture)"
    if model.get("path"):
        return f"A `{base_class}` from `{model['path']}`"
    return f"A `{base_class}`"


def _removed_table(record) -> list[str]:
    lines = ["## Removed heads", "",
             f"Head indices are those of the original model (0 to {record.num_heads - 1} in every layer), "
             "whatever order the pruning happened in. The same record is in `config.json` under `sinv_prune`.", "",
             "| layer | heads kept | removed heads |", "| ---: | ---: | --- |"]  # fmt: skip
    for layer in range(record.num_layers):
        removed = sorted(HEADS.recorded(record).get(layer, []))
        shown = ", ".join(str(h) for h in removed) or "-"
        lines.append(f"| {layer} | {record.num_heads - len(removed)} | {shown} |")
    return lines + [""]


def _evaluation(results, row, stage, recipe, baseline, after, pushed_gguf: bool = False) -> list[str]:
    lines = ["## Evaluation", ""]
    if not row or not baseline:
        note = "the run's results do not include this arm" if results else "no run results were attached"
        return lines + [f"Not evaluated here ({note}); see `sinv_prune.pipeline.evaluation` to measure it.", ""]
    run = results.get("run") or {}
    mlm = run.get("task") == "masked-lm"
    ppl = "MLM perplexity" if mlm else "perplexity"
    names = task_names(results)
    tasks = "".join(f" {task_header(results, n)} |" for n in names)
    gguf = results.get("gguf") or {}
    lines += [f"| model | parameters | {ppl} |{tasks}" + (" GGUF (llama.cpp) |" if gguf else ""),
              "| --- | ---: | ---: |" + " ---: |" * (len(names) + bool(gguf))]  # fmt: skip
    final = "finetuned" if row.get("finetuned") else "pruned"  # the arm's model export.gguf wrote
    models = [("base model", baseline, gguf.get("baseline"))] + [
        (label + (" **(this checkpoint)**" if key == stage else ""), row[key], gguf.get(row.get("name")) if key == final
         else None)
        for key, label in (("pruned", "pruned"), ("finetuned", "pruned + fine-tuned"))
        if row.get(key)
    ]  # fmt: skip
    for label, ev, file in models:
        cells = "".join(f" {task_cell(ev, n)} |" for n in names) + (f" {gguf_cell(file) or '-'} |" if gguf else "")
        lines.append(f"| {label} | {_num(ev.get('params'))} | {_num(ev.get('perplexity'), 3)} |{cells}")
    lines += ["", _data_sentence(recipe, run, after.get("eval") or baseline.get("eval") or {}, mlm), ""]
    if gguf:
        where = ("this checkpoint's file is in this repository, see *Use with llama.cpp*; the others are in the "
                 "run directory" if pushed_gguf else "in the run directory; not part of this repository")  # fmt: skip
        lines += [f"GGUF (llama.cpp): type and size of the file the run's `export.gguf` wrote of each model "
                  f"({where}).", ""]  # fmt: skip
    pins = task_pins(results) if names else None
    if pins:
        lines += ["Zero-shot tasks through lm-evaluation-harness (acc_norm where a task reports it, else acc, "
                  "± standard error): " + pins_text(pins), ""]  # fmt: skip
    speed = after.get("speed") or {}
    if speed.get("speedup_vs_baseline"):
        how = (f"{speed.get('repeats')} interleaved runs, batch {speed.get('batch_size')} x {speed.get('seq_len')} "
               f"tokens, `{speed.get('device')}`, {speed.get('threads')} threads")  # fmt: skip
        cell = speed_cell(speed)
        if speed.get("resolved") is False:
            lines += [f"Forward-pass speed: {cell} (the speed-up was within the noise of an A/A control; {how}).", ""]
        else:
            lines += [f"Forward-pass speed-up against the base model, median [IQR]: {cell} ({how}).", ""]
    return lines


def _data_sentence(recipe, run, ev: dict, mlm: bool) -> str:
    data = (recipe or {}).get("data") or {}
    split = run.get("eval_split", "test")
    if data.get("hub"):
        hub = data["hub"]
        source = f"the `{split}` split of the Hub data set `{hub.get('path')}`" + (
            f" (`{hub['name']}`)" if hub.get("name") else ""
        )
    elif data.get("files"):
        source = f"the `{split}` file `{data['files'].get(split, '?')}` of the run"
    elif "synthetic" in data:
        source = f"the `{split}` split of sinv_prune's built-in synthetic corpus (seed {data['synthetic'].get('seed')})"
    else:
        source = f"the run's `{split}` split"
    tokens = f"{ev['tokens']:,} scored tokens" if ev.get("tokens") else "all its tokens"
    if mlm:
        method = (f"fixed-mask MLM loss: the same {ev.get('mask_prob', 0.15):.0%} of positions (seed {ev.get('seed')}) "
                  f"replaced by `[MASK]` for every model, blocks of {ev.get('seq_len')} tokens; MLM perplexity is "
                  "exp(mean cross-entropy over the masked positions), not a pseudo-perplexity")  # fmt: skip
    else:
        method = (f"strided-window perplexity: windows of {ev.get('seq_len')} tokens with stride {ev.get('stride')}, "
                  "each token scored once, perplexity = exp(token-weighted mean NLL)")  # fmt: skip
    cap = f", first {data['max_eval_tokens']:,} tokens" if data.get("max_eval_tokens") else ""
    return (f"Measured on {source}{cap} ({tokens}), tokenized as one stream with the run's tokenizer. "
            f"Method: {method} (sinv_prune's `docs/evaluation.md`). Every model was evaluated on the same tokens, "
            "so the rows compare; numbers from other tokenizers or window settings do not.")  # fmt: skip


def _how_to_load(repo_id: str, record, auto: str, has_tokenizer: bool) -> list[str]:
    tok = [f'tokenizer = AutoTokenizer.from_pretrained("{repo_id}")'] if has_tokenizer else []
    imports = f"from transformers import {auto}" + (", AutoTokenizer" if has_tokenizer else "")
    if record is None or record.stock_layout:
        why = (
            "no extra package or remote code is needed: every layer keeps the same number of heads, so the "
            "config's own `num_attention_heads` / `num_key_value_heads` / `head_dim` describe the pruned shapes."
        )
        code = ["```python", imports, "", f'model = {auto}.from_pretrained("{repo_id}")', *tok, "```"]
        if record is None:
            why = "a plain transformers checkpoint."
        return ["## How to load", "", f"With transformers alone; {why}", "", *code, ""]
    return [
        "## How to load",
        "",
        "The layers keep different numbers of heads (or the architecture has no config field for a pruned head "
        "count), so the checkpoint ships `modeling_sinv_prune.py`, a three-line shim that rebuilds the pruned "
        "shapes from the record in `config.json` through the installed `sinv_prune` package (not on PyPI: "
        "install it from its repository, `pip install .` in a clone, or pip's `sinv_prune @ git+URL` form with "
        "the repository's git URL).",
        "",
        "```python",
        imports,
        "",
        f'model = {auto}.from_pretrained("{repo_id}", trust_remote_code=True)',
        *tok,
        "",
        "# or, without remote code:",
        "import sinv_prune",
        "",
        f'model = sinv_prune.from_pretrained("{repo_id}")',
        "```",
        "",
        f"The class is `{PREFIX}{record.base_class}`, a subclass of transformers' `{record.base_class}`.",
        "",
    ]


def _llama_cpp(repo_id: str, files: list) -> list[str]:
    """How to run the pushed GGUF file(s) in llama.cpp: each file's type, size and architecture, then the commands."""
    if not files:
        return []
    lines = ["## Use with llama.cpp", "",
             "This repository also holds the checkpoint as a GGUF file, the format llama.cpp (and the tools built "
             "on it) runs:", ""]  # fmt: skip
    for f in files:
        vocab = "" if f.vocab else "; no vocabulary: token ids in, logits out, so it cannot tokenize text or chat"
        lines.append(f"- `{f.name}`: type `{f.type}`, {file_size(f.size_bytes)}, llama.cpp architecture "
                     f"`{f.arch}`{vocab}")  # fmt: skip
    first = files[0]
    run = [f"hf download {repo_id} {first.name} --local-dir ."]
    if first.vocab:  # a vocabulary-free file takes token ids through the API only
        run += [f"llama-cli -m {first.name}      # run it in the terminal",
                f"llama-server -m {first.name}   # an OpenAI-compatible server on http://localhost:8080"]  # fmt: skip
    lines += ["", "```bash", *run, "```", ""]
    return lines


def _provenance(record, results, arm) -> list[str]:
    lines = ["## Versions", ""]
    if record is not None:
        lines.append(f"- pruned with sinv_prune {record.version}; card written by sinv_prune {__version__}")
    else:
        lines.append(f"- card written by sinv_prune {__version__}")
    lines.append(f"- transformers {transformers.__version__} at push time")
    run = (results or {}).get("run") or {}
    if run.get("name"):
        lines.append(f"- run `{run['name']}`" + (f", arm `{arm}`" if arm else "") + f", device `{run.get('device')}`")
    return lines + [""]


# -- helpers ------------------------------------------------------------------------------------


def _parse_yaml(text: str | None) -> dict | None:
    if not text:
        return None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError:
        return None
    return data if isinstance(data, dict) else None


def _datasets(recipe: dict | None) -> list[str] | None:
    hub = (((recipe or {}).get("data") or {}).get("hub")) or {}
    return [hub["path"]] if hub.get("path") else None


def _num(value: Any, digits: int = 0) -> str:
    if value is None:
        return "-"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _longest_backtick_run(text: str) -> int:
    return max((len(m) for m in re.findall(r"`+", text)), default=0)


def gguf_cell(entry: dict | None) -> str | None:
    """``"q8_0, 12.3 MiB"``: type and size of one ``results["gguf"]`` entry (None: no file)."""
    return f"{entry['type']}, {file_size(entry['size_bytes'])}" if entry else None


def file_size(size_bytes: int) -> str:
    """``"12.3 MiB"``, or ``"84.5 KiB"`` below one MiB (tiny models would all read 0.1 MiB)."""
    if size_bytes < 2**20:
        return f"{size_bytes / 2**10:,.1f} KiB"
    return f"{size_bytes / 2**20:,.1f} MiB"


def speed_cell(speed: dict | None, *, baseline: bool = False) -> str | None:
    """``"1.31 [1.27, 1.35]"``; ``"below resolution"`` when its spread overlaps the A/A control's.

    The baseline's own cell is its A/A control (the base timed against itself). Results from
    before the control was measured show the bare median, marked as such.
    """
    if not speed or speed.get("speedup_vs_baseline") is None:
        return None
    if "resolved" not in speed:
        return f"{speed['speedup_vs_baseline']:.2f} (spread not measured)"
    if baseline:
        control = speed["control"]
        return f"A/A {control['speedup']:.2f} {_interval(control['speedup_iqr'])}"
    if not speed["resolved"]:
        return "below resolution"
    return f"{speed['speedup_vs_baseline']:.2f} {_interval(speed['speedup_iqr'])}"


def _interval(pair: list[float]) -> str:
    return f"[{pair[0]:.2f}, {pair[1]:.2f}]"
