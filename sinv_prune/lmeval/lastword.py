"""The offline WikiText-2 last-word task: a LAMBADA-style lm-eval task built from local text.

LAMBADA (Paperno et al. 2016) asks for the last word of a passage; lm-eval's ``lambada_openai``
scores it as the log-likelihood of ``" " + word`` after the passage: ``acc`` is the share of
passages where every token of the word is the model's greedy choice, ``perplexity`` is
``exp(-mean log-likelihood)`` of the words. This module builds the same kind of task from the
WikiText-2 test paragraphs, which are on this machine where the Hub is not:

* a paragraph is a non-blank line that is not a ``= heading =``;
* trailing punctuation tokens (``.``, ``"``, ``)`` ...) are dropped; the target is the last
  token left, and the paragraph is skipped unless that token is a word (letters only, so
  never ``<unk>`` or a number) with at least :data:`MIN_CONTEXT_WORDS` tokens before it;
* the context is the tokens before it, detokenized with lm-eval's own WikiText detokenizer
  (``@-@`` -> ``-``, `` , `` -> ``, `` ...), so a pretrained model reads ordinary text.

Unlike LAMBADA the passages are not filtered for words that need the whole passage, so the
scores are lower and mean "predicts the paragraph's last word", not broad-context reading.
The data never enter the repository: :func:`build_lastword_task` writes the JSON lines and a
copy of the task YAML (with the JSON's absolute path) into a directory the caller owns (the run
directory, or :func:`cache_root` for ``sinv-prune eval``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import yaml

TASK_NAME = "wikitext_lastword"
#: Fewest context tokens a paragraph needs to become an item.
MIN_CONTEXT_WORDS = 20
#: Bumped whenever the construction above changes (it is the task's ``metadata.version``).
TASK_VERSION = 1.0
TEMPLATE = Path(__file__).with_name(f"{TASK_NAME}.yaml")


def wikitext_dir() -> Path:
    """Where WikiText-2 (word level) lives: ``$SINV_PRUNE_WIKITEXT``, else ``../shared/data/wikitext-2``
    beside the checkout this package was imported from."""
    env = os.environ.get("SINV_PRUNE_WIKITEXT")
    if env:
        return Path(env).expanduser()
    return Path(__file__).resolve().parents[3] / "shared" / "data" / "wikitext-2"


def source_file(source: str | os.PathLike | None = None) -> Path:
    """The WikiText-2 ``test.txt`` the task is built from; ``FileNotFoundError`` (one line) if absent."""
    path = Path(source) if source is not None else wikitext_dir() / "test.txt"
    if path.is_dir():
        path = path / "test.txt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{TASK_NAME}: WikiText-2 test text not found at {path}; set SINV_PRUNE_WIKITEXT to the directory "
            "holding test.txt (word-level WikiText-2)"
        )
    return path


def lastword_items(lines: list[str]) -> list[dict]:
    """The task's documents, ``{"context", "target", "line"}``, one per usable paragraph, in file order."""
    from sinv_prune.lmeval.dependency import require_lm_eval

    require_lm_eval()
    from lm_eval.tasks.wikitext.preprocess_wikitext import wikitext_detokenizer

    items = []
    for number, line in enumerate(lines, start=1):
        words = line.split()
        if not words or (words[0] == "=" and words[-1] == "="):
            continue
        while words and not any(c.isalnum() for c in words[-1]):
            words.pop()
        if len(words) <= MIN_CONTEXT_WORDS or not words[-1].isalpha() or words[-2].startswith("@"):
            continue
        context = wikitext_detokenizer({"page": " ".join(words[:-1])}).strip()
        items.append({"context": context, "target": words[-1], "line": number})
    return items


def cache_root() -> Path:
    """Where ``sinv-prune eval`` keeps built tasks: ``$SINV_PRUNE_CACHE/tasks`` or ``~/.cache/sinv_prune/tasks``."""
    base = os.environ.get("SINV_PRUNE_CACHE")
    return (Path(base).expanduser() if base else Path.home() / ".cache" / "sinv_prune") / "tasks"


def build_lastword_task(dest: str | os.PathLike, source: str | os.PathLike | None = None) -> Path:
    """Write the task into ``dest/wikitext_lastword-<hash>/`` (kept if already there); returns that directory.

    The directory holds ``wikitext_lastword.jsonl``, ``wikitext_lastword.yaml`` (lm-eval's task
    file, pointing at the JSON lines) and ``build.json`` (source file, its sha256, item count).
    The hash covers the source text and :data:`TASK_VERSION`, so a changed source builds anew.
    """
    from sinv_prune.rundir import write_dir

    text_path = source_file(source)
    raw = text_path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    key = hashlib.sha256(f"{digest}:{TASK_VERSION}".encode()).hexdigest()[:12]
    out = Path(dest) / f"{TASK_NAME}-{key}"
    if (out / "build.json").is_file():
        return out
    items = lastword_items(raw.decode("utf-8").splitlines())
    if not items:
        raise ValueError(f"{TASK_NAME}: {text_path} has no paragraph ending in a word")

    def write(tmp: Path) -> None:
        data = tmp / f"{TASK_NAME}.jsonl"
        data.write_text("".join(json.dumps(item, allow_nan=False) + "\n" for item in items), encoding="utf-8")
        config = yaml.safe_load(TEMPLATE.read_text(encoding="utf-8"))
        config["dataset_kwargs"]["data_files"]["test"] = str((out / data.name).resolve())
        config["metadata"]["version"] = TASK_VERSION
        (tmp / TEMPLATE.name).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        build = {"task": TASK_NAME, "source": str(text_path.resolve()), "sha256": digest, "items": len(items)}
        (tmp / "build.json").write_text(json.dumps(build, indent=2, allow_nan=False) + "\n", encoding="utf-8")

    write_dir(out, write)
    return out
