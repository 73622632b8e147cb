"""Push a pruned checkpoint to the Hugging Face Hub, after checking that it reloads.

``push_pruned`` is what ``sinv-prune push`` and a recipe's push stage call:

1. the token comes from ``token=``, ``HF_TOKEN`` or the ``hf auth login`` file
   (``huggingface_hub.get_token()``), never from a recipe;
2. cheap checks first: the Hub answers, the token is valid and may write, the repo does not
   exist yet (or ``overwrite=True``);
3. the checkpoint is reloaded in a fresh Python process the way users will load it (the
   stock class, or ``AutoModel*`` with ``trust_remote_code=True``) and its outputs on fixed
   input ids are compared with the model in memory (or loaded here from the same directory);
   a mismatch stops the push before anything is uploaded;
4. one commit uploads the checkpoint directory, the GGUF file a run's ``export.gguf`` wrote of this
   model (beside it: :mod:`sinv_prune.hub.gguf_files`) and a generated ``README.md`` (model card);
   with ``overwrite=True`` files the repo has and the checkpoint lacks are deleted in the same
   commit, so stale weights cannot shadow the new ones.

Every failure is a ``PushError`` with a one-line message that never contains the token.
All Hub traffic goes through ``huggingface_hub.HfApi``; ``HF_ENDPOINT`` picks the server.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import json
import logging
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from sinv_prune import strict_json
from sinv_prune.version import __version__

logger = logging.getLogger("sinv_prune")

NO_TOKEN = (
    "no Hugging Face token: set HF_TOKEN or run `hf auth login` (`huggingface-cli login`) with a write token "
    "from https://huggingface.co/settings/tokens"
)
CARD = "README.md"
KEEP_REMOTE = {".gitattributes"}
RELOAD_SEQ_LEN = 16
RELOAD_BATCH = 2


class PushError(RuntimeError):
    """A push that cannot go ahead or failed; the message is one line and holds no token."""


@dataclass
class PushResult:
    repo_id: str
    url: str
    revision: str
    commit_url: str
    files: list[str]
    deleted: list[str] = field(default_factory=list)
    created: bool = True
    reload_max_abs_diff: float = 0.0
    reload_route: str = ""


@dataclass
class PushSource:
    """What ``sinv-prune push SOURCE`` points at: the model directory and its run, if any."""

    model_dir: Path
    run_dir: Path | None = None
    arm: str | None = None
    stage: str | None = None
    results: dict | None = None
    recipe_text: str | None = None


# -- the push ----------------------------------------------------------------------------------


def _scrubbing_logs(push):
    """Run ``push`` with every log record scrubbed of the token (see :func:`scrubbed_logs`)."""

    @functools.wraps(push)
    def wrapper(*args, **kwargs):
        try:
            token = resolve_token(kwargs.get("token"))
        except PushError:
            token = None  # push_pruned raises it in its place; token-shaped strings are still scrubbed
        with scrubbed_logs(token):
            return push(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def scrubbed_logs(token: str | None):
    """Scrub ``token`` (and anything shaped like a Hub token or a ``Bearer`` value) from every log
    record made meanwhile, by any logger, at any level.

    At DEBUG level the HTTP stack logs what it sends and receives (httpcore quotes response
    headers verbatim; ``HF_DEBUG`` prints each request as a curl command), so a server echoing
    the token would put it in the console or ``run.log``. The scrub happens when the record is
    made (a log record factory), before any handler, filter or ``caplog`` sees it; the exception
    text of ``logger.exception`` records is formatted and scrubbed then too.
    """
    previous = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = previous(*args, **kwargs)
        message = record.getMessage()
        record.msg, record.args = _scrub(message, token), ()
        if record.exc_info:
            record.exc_text = _scrub(logging.Formatter().formatException(record.exc_info), token)
            record.exc_info = None
        return record

    logging.setLogRecordFactory(factory)
    try:
        yield
    finally:
        logging.setLogRecordFactory(previous)


@_scrubbing_logs
def push_pruned(
    model_dir: str | os.PathLike,
    repo_id: str,
    *,
    private: bool = False,
    revision: str | None = None,
    overwrite: bool = False,
    results: dict | None = None,
    recipe_text: str | None = None,
    token: str | None = None,
    arm: str | None = None,
    stage: str | None = None,
    model: torch.nn.Module | None = None,
    commit_message: str | None = None,
    endpoint: str | None = None,
    timeout: float = 30.0,
    reload_timeout: float = 1800.0,
) -> PushResult:
    """Check that the checkpoint in ``model_dir`` reloads, then push it with a model card to ``repo_id``.

    ``results`` (a run's ``results.json`` content), ``arm`` (the arm's name in it), ``stage``
    (``"pruned"`` or ``"finetuned"``; default: guessed from the directory name) and
    ``recipe_text`` (the resolved recipe YAML) fill the model card; without them the card
    says what the pruning record in ``config.json`` tells. ``model`` is the in-memory model
    the fresh-process reload is compared with (default: loaded here from ``model_dir``).
    ``repo_id`` without a namespace goes to the token's user. ``revision`` is a branch,
    created from ``main`` when missing. ``overwrite=True`` consents to pushing into an
    existing repo; the revision then holds exactly the checkpoint and the card (plus
    ``.gitattributes``). ``timeout`` (seconds) bounds the first requests that check the Hub
    answers; uploads have no time limit.

    Raises ``PushError`` (one line, token-free) on any failure; nothing is uploaded unless
    every check passed.
    """
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    from sinv_prune.hub.gguf_files import gguf_files

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise PushError(f"{model_dir}: not a checkpoint directory (no config.json)")
    token = resolve_token(token)
    api = HfApi(endpoint=endpoint, token=token, library_name="sinv_prune", library_version=__version__)
    where = api.endpoint
    revision = revision or None
    with hub_errors(token, where, repo_id):
        repo_id, existing = _check_hub(api, repo_id, timeout)
    if existing is not None and not overwrite:
        raise PushError(_exists_message(repo_id))
    if existing is not None and private and existing.private is False:
        raise PushError(f"{repo_id} exists and is public; --private only applies to new repos (change it on the Hub)")

    files = checkpoint_files(model_dir)
    try:
        ggufs = gguf_files(model_dir, results, arm)
    except (OSError, ValueError) as err:
        raise PushError(_scrub(f"cannot read a GGUF file of {model_dir}: {_one_line(err)}", token)) from None
    beside = {g.name: g.path for g in ggufs if g.name not in files}  # the run's export, outside model_dir
    stage = stage or (model_dir.name if model_dir.name in ("pruned", "finetuned") else None)
    logger.info("checking that %s reloads in a fresh process", model_dir)
    try:
        check = check_reload(model_dir, model=model, timeout=reload_timeout, token=token)
    except PushError:
        raise
    except Exception as err:  # the in-process load or forward failed
        message = f"reload check failed: {model_dir}: {_one_line(err)}; nothing was uploaded"
        raise PushError(_scrub(message, token)) from None
    logger.info("reload check passed (%s, max |diff| %.2e)", check["route"], check["max_abs_diff"])
    try:
        card = build_card(
            model_dir, repo_id, results=results, arm=arm, stage=stage, recipe_text=recipe_text, check=check,
            gguf=ggufs,
        )  # fmt: skip
    except Exception as err:
        raise PushError(_scrub(f"could not write the model card: {_one_line(err)}", token)) from None
    card = _scrub(card, token)

    with hub_errors(token, where, repo_id):
        created = existing is None and _create_repo(api, repo_id, private=private, overwrite=overwrite)
        if revision and revision != "main":
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        local = {rel: model_dir / rel for rel in files} | beside
        ops: list[Any] = [
            CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path)) for rel, path in local.items()
        ]
        ops.append(CommitOperationAdd(path_in_repo=CARD, path_or_fileobj=card.encode("utf-8")))
        deleted = []
        if not created:  # the repo existed, at the check or since (overwrite=True): drop files we don't push
            keep = set(local) | {CARD} | KEEP_REMOTE
            deleted = sorted(p for p in api.list_repo_files(repo_id, revision=revision) if p not in keep)
            ops += [CommitOperationDelete(path_in_repo=p) for p in deleted]
        logger.info("uploading %d files to %s%s", len(local) + 1, repo_id, f" ({revision})" if revision else "")
        info = api.create_commit(
            repo_id,
            ops,
            commit_message=commit_message or f"Upload pruned model (sinv_prune {__version__})",
            revision=revision,
        )
    url = f"{where.rstrip('/')}/{repo_id}"
    return PushResult(
        repo_id=repo_id,
        url=url,
        revision=revision or "main",
        commit_url=str(info.commit_url),
        files=sorted([*local, CARD]),
        deleted=deleted,
        created=created,
        reload_max_abs_diff=check["max_abs_diff"],
        reload_route=check["route"],
    )


def resolve_token(token: str | None = None) -> str:
    """``token``, else ``HF_TOKEN``, else the ``hf auth login`` token; ``PushError`` when there is none."""
    if token:
        return token
    from huggingface_hub import get_token

    try:
        found = get_token()
    except Exception as err:  # e.g. a failed OIDC exchange
        raise PushError(_scrub(f"could not get a Hugging Face token: {_one_line(err)}", None)) from None
    if not found:
        raise PushError(NO_TOKEN)
    return found


def _check_hub(api, repo_id: str, timeout: float):
    """``(full repo id, repo info or None)``; checks the token is valid and may write."""
    from huggingface_hub.errors import RepositoryNotFoundError

    who = None
    if "/" not in repo_id:
        who = api.whoami()
        repo_id = f"{who['name']}/{repo_id}"
    try:
        existing = api.repo_info(repo_id, timeout=timeout)
    except RepositoryNotFoundError as err:
        if err.response is not None and err.response.status_code == 401 and who is None:
            who = api.whoami()  # 401 means "missing" or "bad token"; whoami tells which
        existing = None
    who = who or api.whoami()
    role = ((who.get("auth") or {}).get("accessToken") or {}).get("role")
    if role == "read":
        raise PushError(
            "the token is read-only; create a token with write access at https://huggingface.co/settings/tokens"
        )
    return repo_id, existing


def _create_repo(api, repo_id: str, *, private: bool, overwrite: bool) -> bool:
    """Create the repo (private, or the namespace's default); False when it appeared since the check."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        api.create_repo(repo_id, private=True if private else None)
        return True
    except HfHubHTTPError as err:
        if err.response is None or err.response.status_code != 409:
            raise
        if not overwrite:
            raise PushError(_exists_message(repo_id)) from None
        return False


def _exists_message(repo_id: str) -> str:
    return (
        f"{repo_id} already exists on the Hub; pass --overwrite (overwrite=True) to push into it, replacing its files"
    )


def checkpoint_files(model_dir: Path) -> list[str]:
    """Every file of the checkpoint, relative POSIX paths; hidden files/dirs and a README.md are left out."""
    out = []
    for path in sorted(model_dir.rglob("*")):
        rel = path.relative_to(model_dir)
        if path.is_file() and not any(part.startswith(".") for part in rel.parts) and rel.as_posix() != CARD:
            out.append(rel.as_posix())
    return out


def build_card(
    model_dir: Path,
    repo_id: str,
    *,
    results: dict | None = None,
    arm: str | None = None,
    stage: str | None = None,
    recipe_text: str | None = None,
    check: dict | None = None,
    gguf: list | None = None,
) -> str:
    """The model card for ``model_dir``; ``check`` (from ``check_reload``) supplies parameter counts, ``gguf``
    the GGUF files pushed with it (default: :func:`~sinv_prune.hub.gguf_files.gguf_files` of ``model_dir``)."""
    from transformers import AutoConfig

    from sinv_prune.hub.gguf_files import gguf_files
    from sinv_prune.hub.model_card import model_card

    config = AutoConfig.from_pretrained(model_dir)
    has_tokenizer = any(model_dir.glob("tokenizer*")) or any(model_dir.glob("vocab*"))
    return model_card(
        config,
        repo_id=repo_id,
        results=results,
        arm=arm,
        stage=stage,
        recipe_text=recipe_text,
        params=(check or {}).get("params"),
        params_before=(check or {}).get("params_before"),
        has_tokenizer=has_tokenizer,
        gguf=gguf_files(model_dir, results, arm) if gguf is None else gguf,
    )


# -- the fresh-process reload check ---------------------------------------------------------------

_WORKER = r"""
import json, sys
import torch, transformers
job = json.load(open(sys.argv[1]))
route, name, path = job["route"], job["class"], job["dir"]
kwargs = {"attn_implementation": "eager"}
if route == "auto":
    model = getattr(transformers, name).from_pretrained(path, trust_remote_code=True, **kwargs)
elif route == "stock":
    model = getattr(transformers, name).from_pretrained(path, **kwargs)
else:
    import sinv_prune
    model = sinv_prune.from_pretrained(path, **kwargs)
model.eval()
with torch.no_grad():
    out = model(input_ids=torch.tensor(job["ids"]))
main = out.logits if getattr(out, "logits", None) is not None else out[0]
torch.save({"main": main.float().cpu(), "class": type(model).__name__}, job["out"])
"""


def reload_route(config) -> tuple[str, str]:
    """How users load this checkpoint: ``("stock", Class)``, ``("auto", AutoClass)`` or ``("sinv", "")``."""
    import transformers

    from sinv_prune.surgery.checkpoint import PREFIX
    from sinv_prune.surgery.record import get_record

    record = get_record(config)
    if record is None or record.stock_layout:
        name = (config.architectures or [None])[0]
        if name and hasattr(transformers, name):
            return "stock", name
        return "sinv", ""
    for auto, target in (getattr(config, "auto_map", None) or {}).items():
        if str(target).endswith("." + PREFIX + record.base_class) and hasattr(transformers, auto):
            return "auto", auto
    return "sinv", ""


def reload_inputs(config) -> torch.Tensor:
    """Fixed input ids: seeded, inside the vocabulary and the position range."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = int(getattr(text, "vocab_size", 0) or 2)
    positions = [getattr(text, k, None) for k in ("n_positions", "max_position_embeddings")]
    limit = min([p for p in positions if isinstance(p, int) and p > 4] or [RELOAD_SEQ_LEN + 4])
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (RELOAD_BATCH, min(RELOAD_SEQ_LEN, limit - 4)), generator=generator)


def check_reload(
    model_dir: str | os.PathLike,
    *,
    model: torch.nn.Module | None = None,
    timeout: float = 1800.0,
    token: str | None = None,
) -> dict:
    """Reload ``model_dir`` in a fresh process and compare its outputs with ``model`` (or a load here).

    Returns ``{"route", "max_abs_diff", "params", "params_before"}``; raises ``PushError`` when
    the fresh process cannot load the checkpoint or its outputs differ.
    """
    from transformers import AutoConfig

    model_dir = Path(model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    route, cls = reload_route(config)
    ids = reload_inputs(config)
    reference, params, params_before = _reference(model_dir, model, ids)
    fresh = _fresh_outputs(model_dir, route, cls, ids, timeout=timeout, token=token)
    described = f"{cls}.from_pretrained" + (", trust_remote_code=True" if route == "auto" else "")
    described = described if route != "sinv" else "sinv_prune.from_pretrained"
    if fresh.shape != reference.shape:
        shapes = f"{tuple(fresh.shape)}, the model here {tuple(reference.shape)}"
        raise PushError(f"reload check failed: {described} in a fresh process gives outputs of shape {shapes}")
    diff = float((fresh - reference).abs().max()) if reference.numel() else 0.0
    scale = max(1.0, float(reference.abs().max())) if reference.numel() else 1.0
    tol = _tolerance(model_dir, model) * scale
    if not diff <= tol:  # also catches NaN
        raise PushError(f"reload check failed: {described} in a fresh process gives different outputs "
                        f"(max |diff| {diff:.3g} > {tol:.1g}); the saved checkpoint does not match the model; "
                        "nothing was uploaded")  # fmt: skip
    return {"route": described, "max_abs_diff": diff, "params": params, "params_before": params_before}


def _reference(model_dir: Path, model, ids: torch.Tensor) -> tuple[torch.Tensor, int, int | None]:
    from sinv_prune.surgery.checkpoint import from_pretrained
    from sinv_prune.surgery.removal import count_parameters

    loaded = model is None
    if loaded:
        model = from_pretrained(model_dir, attn_implementation="eager")
    training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            out = model(input_ids=ids.to(device))
        main = out.logits if getattr(out, "logits", None) is not None else out[0]
        main = main.float().cpu()
        params = count_parameters(model)
        before = original_parameters(model)
    finally:
        model.train(training)
    if loaded:
        del model
    return main, params, before


def original_parameters(model: torch.nn.Module) -> int | None:
    """Parameters of the model before pruning (rebuilt on the meta device from the record), or None."""
    from sinv_prune.surgery.checkpoint import base_class, set_head_counts
    from sinv_prune.surgery.record import get_record
    from sinv_prune.surgery.removal import count_parameters

    record = get_record(model.config)
    if record is None:
        return None
    try:
        from sinv_prune.arch import get_adapter

        config = copy.deepcopy(model.config)
        delattr(config, "sinv_prune")
        if record.stock_layout:
            set_head_counts(get_adapter(model), config, record.num_heads, record.num_kv_heads, record.head_dim)
        with torch.device("meta"):
            original = base_class(type(model))(config)
        return count_parameters(original)
    except Exception:  # only a card detail: leave it out rather than fail the push
        logger.debug("could not rebuild the unpruned model to count its parameters", exc_info=True)
        return None


def _tolerance(model_dir: Path, model) -> float:
    dtype = next(model.parameters()).dtype if model is not None else _saved_dtype(model_dir)
    return 1e-4 if dtype in (torch.float32, torch.float64, None) else 2e-2


def _saved_dtype(model_dir: Path) -> torch.dtype | None:
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    name = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, name, None) if isinstance(name, str) else None


def _fresh_outputs(model_dir: Path, route: str, cls: str, ids: torch.Tensor, *, timeout: float, token) -> torch.Tensor:
    """Run ``_WORKER`` with ``sys.executable``: offline, no token, an empty remote-code module cache."""
    with tempfile.TemporaryDirectory(prefix="sinv_prune_reload_") as tmp:
        job = {"route": route, "class": cls, "dir": str(model_dir.resolve()), "ids": ids.tolist(),
               "out": str(Path(tmp) / "out.pt")}  # fmt: skip
        job_file = Path(tmp) / "job.json"
        job_file.write_text(strict_json.dumps(job))
        env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
        package_root = str(Path(importlib.import_module("sinv_prune").__file__).resolve().parents[1])
        env.update(
            HF_HUB_OFFLINE="1",
            HF_MODULES_CACHE=str(Path(tmp) / "modules"),
            TRANSFORMERS_VERBOSITY="error",
            PYTHONPATH=os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")])),
        )
        try:
            proc = subprocess.run(
                [sys.executable, "-c", _WORKER, str(job_file)],
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
            )
        except subprocess.TimeoutExpired:
            raise PushError(f"reload check failed: loading {model_dir} in a fresh process took over "
                            f"{timeout:.0f}s; nothing was uploaded") from None  # fmt: skip
        if proc.returncode != 0:
            last = next((ln for ln in reversed(proc.stderr.strip().splitlines()) if ln.strip()), "no error output")
            raise PushError(_scrub(f"reload check failed: {model_dir} does not load in a fresh process "
                                   f"({last.strip()}); nothing was uploaded", token))  # fmt: skip
        return torch.load(job["out"], weights_only=True)["main"]


# -- where SOURCE points ---------------------------------------------------------------------------


def resolve_source(path: str | os.PathLike) -> PushSource:
    """Find the model directory and its run for ``sinv-prune push SOURCE``.

    SOURCE may be a checkpoint directory (``RUN/arms/NAME/finetuned``, ``RUN/arms/NAME/pruned``,
    ``RUN/base`` or any directory with a ``config.json``), an arm directory
    (``RUN/arms/NAME``: its fine-tuned model if there is one, else its pruned model) or
    ``RUN/NAME`` with the arm's name as the recipe labels it.
    """
    path = Path(path)
    if (path / "config.json").is_file():
        return _with_run(PushSource(model_dir=path), run_of_model(path))
    if path.is_dir() and (path / "results.json").is_file() and (path / "arms").is_dir():
        raise PushError(f"{path} is a run directory; name an arm: {path}/ARM (arms: {_arm_names(path)})")
    arm_dir = path if _is_arm_dir(path) else _arm_dir_by_name(path)
    if arm_dir is None:
        inside = sorted(d.name for d in path.iterdir() if (d / "config.json").is_file()) if path.is_dir() else []
        hint = f"; checkpoints inside it: {', '.join(inside)}" if inside else ""
        raise PushError(f"{path}: not a checkpoint directory, an arm directory (RUN/arms/NAME) or RUN/ARM_NAME{hint}")
    model_dir = next(arm_dir / s for s in ("finetuned", "pruned") if (arm_dir / s / "config.json").is_file())
    run = arm_dir.parent.parent if arm_dir.parent.name == "arms" else None
    return _with_run(PushSource(model_dir=model_dir), run)


def _is_arm_dir(path: Path) -> bool:
    return any((path / s / "config.json").is_file() for s in ("finetuned", "pruned"))


def _arm_dir_by_name(path: Path) -> Path | None:
    run, name = path.parent, path.name
    if not (run / "arms").is_dir():
        return None
    results = _read_json(run / "results.json") or {}
    for row in results.get("arms", []):
        if row.get("name") == name and row.get("model_dir"):
            candidate = (run / row["model_dir"]).parent
            if _is_arm_dir(candidate):
                return candidate
    safe = "".join(c if c.isalnum() or c in "-_.=" else "_" for c in name)  # as the pipeline names arm dirs
    candidate = run / "arms" / safe
    if _is_arm_dir(candidate):
        return candidate
    raise PushError(f"{run} has no arm {name!r} (arms: {_arm_names(run)})")


def _arm_names(run: Path) -> str:
    rows = (_read_json(run / "results.json") or {}).get("arms") or []
    names = [row["name"] for row in rows if row.get("name")] or sorted(
        p.name for p in (run / "arms").iterdir() if p.is_dir() and not p.name.startswith(".")
    )
    return ", ".join(names) or "none"


def run_of_model(model_dir: Path) -> Path | None:
    if model_dir.parent.parent.name == "arms":
        return model_dir.parent.parent.parent
    if model_dir.name == "base" and (model_dir.parent / "recipe.yaml").is_file():
        return model_dir.parent
    return None


def _with_run(source: PushSource, run: Path | None) -> PushSource:
    if run is None or not ((run / "results.json").is_file() or (run / "recipe.yaml").is_file()):
        return source
    source.run_dir = run
    source.results = _read_json(run / "results.json")
    recipe = run / "recipe.yaml"
    source.recipe_text = recipe.read_text(encoding="utf-8") if recipe.is_file() else None
    stage = source.model_dir.name if source.model_dir.name in ("pruned", "finetuned") else None
    source.stage = stage
    arm_rel = None
    with contextlib.suppress(ValueError):
        arm_rel = source.model_dir.parent.resolve().relative_to(run.resolve())
    if stage and arm_rel is not None:
        for row in (source.results or {}).get("arms", []):
            if row.get("model_dir") and Path(row["model_dir"]).parent == arm_rel:
                source.arm = row.get("name")
        if source.arm is None:
            state = _read_json(run / "state.json") or {}
            source.arm = next(
                (name for name, arm in (state.get("arms") or {}).items()
                 if Path(arm.get("pruned_dir", "")).parent == arm_rel),
                None,
            )  # fmt: skip
    return source


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# -- errors -------------------------------------------------------------------------------------


@contextlib.contextmanager
def hub_errors(token: str | None, endpoint: str, repo_id: str):
    """Turn huggingface_hub / HTTP failures into a one-line, token-free ``PushError``."""
    try:
        yield
    except PushError as err:
        raise PushError(_scrub(str(err), token)) from None
    except Exception as err:
        raise PushError(_scrub(describe_error(err, endpoint, repo_id), token)) from None


def describe_error(err: BaseException, endpoint: str, repo_id: str) -> str:
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    timeouts, transport = _transport_errors()
    for cause in _chain(err):
        if isinstance(cause, OfflineModeIsEnabled):
            return "cannot reach the Hub: offline mode is on (HF_HUB_OFFLINE); unset it to push"
        if isinstance(cause, HfHubHTTPError) and cause.response is not None:
            return _http_message(cause, repo_id)
        if isinstance(cause, timeouts):
            return f"the Hub at {endpoint} did not answer in time ({type(cause).__name__})"
        if isinstance(cause, transport):
            return f"cannot reach the Hub at {endpoint}: {_one_line(cause)}"
    return f"push to {repo_id} failed: {_one_line(err)}"


def _http_message(err, repo_id: str) -> str:
    status = err.response.status_code
    server = err.server_message or err.response.headers.get("X-Error-Message") or ""
    detail = f" ({_one_line(server)})" if server else ""
    if status == 401:
        return (f"the Hub rejected the token (HTTP 401){detail}: set a valid write token in HF_TOKEN "
                "or run `hf auth login`")  # fmt: skip
    if status == 403:
        return f"the token may not write to {repo_id} (HTTP 403){detail}: use a token with write access there"
    if status == 404:
        return f"{repo_id} or its revision was not found on the Hub (HTTP 404){detail}"
    return f"the Hub answered HTTP {status}{detail} while pushing to {repo_id}"


def _transport_errors() -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(timeout, other transport) exception classes of whichever HTTP client huggingface_hub uses."""
    timeouts: list[type] = [TimeoutError]
    transport: list[type] = [ConnectionError]
    for module, timeout_name, transport_name in (
        ("httpx2", "TimeoutException", "TransportError"),
        ("httpx", "TimeoutException", "TransportError"),
        ("requests", "Timeout", "ConnectionError"),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        timeouts.append(getattr(mod, timeout_name))
        transport.append(getattr(mod, transport_name))
    return tuple(timeouts), tuple(transport)


def _chain(err: BaseException):
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        yield err
        err = err.__cause__ or err.__context__


# Hub user and org tokens, and JSON web tokens (what an OIDC exchange for a Hub token handles).
_TOKEN_LIKE = re.compile(
    r"\b(hf_[A-Za-z0-9]{8,}|api_org_[A-Za-z0-9]{8,}|eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*)"
)
_BEARER = re.compile(r"(?i)(bearer\s+)\S+")


def _scrub(text: str, token: str | None) -> str:
    """``text`` without the token (or anything shaped like one)."""
    if token:
        text = text.replace(token, "***")
    return _BEARER.sub(r"\1***", _TOKEN_LIKE.sub("***", text))


def _one_line(err: BaseException | str) -> str:
    text = str(err) if not isinstance(err, str) else err
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    return " ".join(first.split()) or (type(err).__name__ if not isinstance(err, str) else "")
