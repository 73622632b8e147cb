"""Pushing to the Hub: the real upload code against a stand-in Hub (``hub_server.py``) on 127.0.0.1.

huggingface_hub reads ``HF_ENDPOINT`` at import time into ``huggingface_hub.constants.ENDPOINT``
(and ``HUGGINGFACE_CO_URL_TEMPLATE``, used by downloads), and every ``HfApi()`` copies the
endpoint when it is built; ``push_pruned`` builds its ``HfApi`` per push and transformers caches
one in ``transformers.utils.hub._hf_api``. So the tests patch those two constants and reset that
cache; no test talks to the real Hub.

The fresh-process reload costs an interpreter start plus torch and transformers imports, so one
push (``pushed``, the CLI push of a run's arm, shared by several tests) spawns the real process;
the stock-layout and corrupted-checkpoint pushes run the same worker script in this process
(``worker_in_process``); the other tests fail before the check or stub it.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
import torch
import transformers
import yaml
from click.testing import CliRunner
from conftest import VOCAB, model_inputs, model_output, tiny_model
from hub_server import StandInHub
from huggingface_hub import constants
from safetensors.torch import load_file, save_file

import sinv_prune
from sinv_prune.cli import main
from sinv_prune.hub import push as hub_mod
from sinv_prune.hub.model_card import model_card
from sinv_prune.hub.push import PushError, hub_errors, push_pruned, resolve_source
from sinv_prune.pipeline.recipe import recipe_to_yaml, validate_recipe
from sinv_prune.surgery.removal import count_parameters

TOKEN = "hf_StandInTokenThatMustNeverLeak42"
WRONG = "hf_WrongTokenAlsoNeverPrinted777"
ODD = "oidc.NotShapedLikeAHubToken.5d41402a"  # only replacing the token itself hides this one
ARM = "taylor-3-global"
GPT2_REMOVED = {0: [1, 3], 2: [0]}
LLAMA_REMOVED = {0: [0, 3], 1: [1, 5], 2: [2, 4]}  # 2 of 3 heads kept in each KV group: stock layout


# -- the stand-in Hub and what the tests push ------------------------------------------------------


@pytest.fixture(scope="module")
def hub():
    server = StandInHub(TOKEN).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf_home")


def point_at(mp: pytest.MonkeyPatch, url: str, home: Path) -> None:
    """Send huggingface_hub (and transformers' cached HfApi) to ``url``; no login file, no cache."""
    mp.setattr(constants, "ENDPOINT", url)
    mp.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    mp.setattr(constants, "HF_HUB_OFFLINE", False)
    mp.setattr(constants, "HF_HUB_DISABLE_XET", True)  # the stand-in speaks basic LFS, not Xet
    mp.setattr(constants, "HF_TOKEN_PATH", str(home / "token"))
    mp.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    mp.setattr(transformers.utils.hub, "_hf_api", None)
    mp.setenv("HF_TOKEN", TOKEN)
    mp.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    mp.delenv("HF_OIDC_RESOURCE", raising=False)


@pytest.fixture(scope="module")
def hub_env(hub, hf_home):
    with pytest.MonkeyPatch.context() as mp:
        point_at(mp, hub.url, hf_home)
        yield mp


@pytest.fixture(autouse=True)
def _clean_hub(hub, hub_env):
    hub.reset()
    yield
    assert not hub.errors, hub.errors  # the stand-in itself never failed


def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 1)} | {"[UNK]": VOCAB - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A recipe run as the pipeline leaves it, with one arm (pruned, then "fine-tuned") of a tiny GPT-2."""
    root = tmp_path_factory.mktemp("run")
    recipe = validate_recipe({
        "name": "hubtest",
        "model": {"architecture": "gpt2", "config": {"n_layer": 3, "n_head": 4, "n_embd": 32, "n_positions": 64}},
        "data": {"synthetic": {"seed": 0}, "tokenizer": {"kind": "word"}, "seq_len": 64, "eval_stride": 32},
        "train": {"epochs": 1},
        "prune": {"arms": [{"criterion": "taylor", "amount": 3}]},
        "finetune": {"epochs": 1},
    })  # fmt: skip
    assert recipe.prune.arms[0].label == ARM
    arm = root / "arms" / ARM
    model = tiny_model("gpt2")
    params_before = count_parameters(model)
    sinv_prune.prune_heads(model, GPT2_REMOVED)
    model.save_pretrained(arm / "pruned")
    torch.manual_seed(1)
    with torch.no_grad():  # stands in for fine-tuning: different weights from the pruned model's
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    model.save_pretrained(arm / "finetuned")
    word_tokenizer().save_pretrained(arm / "finetuned")
    (arm / "checkpoints" / "checkpoint-10").mkdir(parents=True)
    (arm / "checkpoints" / "checkpoint-10" / "optimizer.pt").write_bytes(b"not for the Hub")
    ev = {"tokens": 4321, "seq_len": 64, "stride": 32, "method": "strided-window"}
    params = count_parameters(model)
    results = {
        "baseline": {"params": params_before, "perplexity": 12.5, "eval": ev, "model_dir": "base"},
        "arms": [{
            "name": ARM, "criterion": "taylor", "options": {}, "amount": 3, "mode": "global", "seed": 0,
            "heads_removed": 3, "removed": {"0": [1, 3], "2": [0]},
            "pruned": {"params": params, "perplexity": 14.25, "eval": ev},
            "finetuned": {"params": params, "perplexity": 12.75, "eval": ev},
            "model_dir": f"arms/{ARM}/finetuned", "params": params, "perplexity": 12.75,
        }],
        "run": {"name": "hubtest", "device": "cpu", "eval_split": "test", "task": "causal-lm", "train": None},
    }  # fmt: skip
    (root / "results.json").write_text(json.dumps(results, indent=2))
    (root / "recipe.yaml").write_text(recipe_to_yaml(recipe))
    state = {
        "finished": [],
        "arms": {ARM: {"pruned_dir": f"arms/{ARM}/pruned", "finetuned_dir": f"arms/{ARM}/finetuned"}},
    }
    (root / "state.json").write_text(json.dumps(state))
    return SimpleNamespace(root=root, arm=arm, model=model, results=results, params_before=params_before)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    model = tiny_model("llama")
    sinv_prune.prune_heads(model, LLAMA_REMOVED)
    assert model.config.sinv_prune["stock_layout"]
    path = tmp_path_factory.mktemp("llama") / "checkpoint"
    model.save_pretrained(path)
    return SimpleNamespace(path=path, model=model)


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(self.format(record))


@pytest.fixture(scope="module")
def pushed(hub, hub_env, run_dir):
    """``sinv-prune push RUN/ARM`` once, with every logger at DEBUG; the tests below read what happened."""
    hub.reset()
    capture, root = Capture(), logging.getLogger()
    level, hf_level = root.level, huggingface_hub.utils.logging.get_verbosity()
    root.addHandler(capture)
    root.setLevel(logging.DEBUG)
    huggingface_hub.utils.logging.set_verbosity_debug()
    spawned, real_run = [], subprocess.run

    def spy(cmd, **kwargs):
        spawned.append((cmd, kwargs.get("env")))
        return real_run(cmd, **kwargs)

    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(subprocess, "run", spy)
            args = ["push", str(run_dir.root / ARM), "--repo-id", "tester/gpt2-pruned", "--private"]
            result = CliRunner().invoke(main, args)
    finally:
        root.removeHandler(capture)
        root.setLevel(level)
        huggingface_hub.utils.logging.set_verbosity(hf_level)
    repo = hub.repos.get("tester/gpt2-pruned")
    return SimpleNamespace(
        result=result,
        logs="\n".join(capture.lines),
        received=dict(hub.received.get("tester/gpt2-pruned", {})),
        files=hub.files("tester/gpt2-pruned") if repo else {},
        private=repo.private if repo else None,
        commits=list(repo.commits) if repo else [],
        validated=list(hub.validated_yaml),
        unknown=list(hub.unknown),
        spawned=spawned,
    )


@pytest.fixture
def worker_in_process(monkeypatch):
    """Run the fresh-process worker script in this process instead (saves an interpreter start)."""
    real_run = subprocess.run

    def run(cmd, **kwargs):
        if cmd[:3] != [sys.executable, "-c", hub_mod._WORKER]:
            return real_run(cmd, **kwargs)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "argv", ["-c", *cmd[3:]])
            exec(compile(hub_mod._WORKER, "<sinv_prune reload worker>", "exec"), {"__name__": "__main__"})
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", run)


def card_parts(text: str) -> tuple[dict, str]:
    _, meta, body = text.split("---\n", 2)
    return yaml.safe_load(meta), body


# -- the CLI push of a run's arm ------------------------------------------------------------------


def test_cli_push_uploads_exactly_the_final_checkpoint_and_a_card(pushed, run_dir):
    assert pushed.result.exit_code == 0, pushed.result.output
    final = run_dir.arm / "finetuned"
    on_disk = {p.name for p in final.iterdir()}
    assert "modeling_sinv_prune.py" in on_disk and "tokenizer.json" in on_disk
    assert set(pushed.received) == on_disk | {"README.md"}
    for name in on_disk:
        assert pushed.received[name] == (final / name).read_bytes(), name
    assert set(pushed.files) == on_disk | {"README.md", ".gitattributes"}
    assert len(pushed.commits) == 1 and pushed.private is True
    assert pushed.validated == [pushed.received["README.md"].decode()]  # the card's metadata was validated
    assert not pushed.unknown
    ((cmd, env),) = pushed.spawned  # one fresh interpreter, offline, without the token
    assert cmd[:2] == [sys.executable, "-c"] and env["HF_HUB_OFFLINE"] == "1"
    assert "HF_TOKEN" not in env and TOKEN not in json.dumps(env)
    assert "reload check passed (AutoModelForCausalLM.from_pretrained, trust_remote_code=True" in pushed.result.output
    assert f"pushed {len(pushed.received)} files to" in pushed.result.output


def test_the_pushed_checkpoint_reloads_with_identical_outputs(pushed, run_dir, tmp_path):
    local = tmp_path / "download"
    for name, data in pushed.files.items():
        (local / name).parent.mkdir(parents=True, exist_ok=True)
        (local / name).write_bytes(data)
    reloaded = sinv_prune.from_pretrained(local, attn_implementation="eager")
    assert type(reloaded).__name__ == "SinvPrunedGPT2LMHeadModel"
    torch.testing.assert_close(model_output(reloaded, model_inputs()), model_output(run_dir.model, model_inputs()))


def test_the_card_says_what_was_removed_how_and_with_what_effect(pushed, run_dir):
    meta, body = card_parts(pushed.received["README.md"].decode())
    assert meta["library_name"] == "transformers"
    assert {"sinv-prune", "pruned", "attention-head-pruning"} <= set(meta["tags"])
    assert meta["pipeline_tag"] == "text-generation"
    assert "base_model" not in meta  # trained from scratch by the recipe
    assert "| 0 | 2 | 1, 3 |" in body and "| 1 | 4 | - |" in body and "| 2 | 3 | 0 |" in body
    assert "`taylor`" in body and "pruned, then fine-tuned" in body
    params = run_dir.results["arms"][0]["params"]
    assert f"{run_dir.params_before:,} before, {params:,} after" in body
    assert "| base model |" in body and "12.500" in body and "14.250" in body and "12.750" in body
    assert "`test` split" in body and "synthetic corpus" in body and "strided-window" in body
    assert "4,321 scored tokens" in body and "stride 32" in body
    assert (run_dir.root / "recipe.yaml").read_text().strip() in body
    assert "trust_remote_code=True" in body and "`pip install .` in a clone" in body
    assert "pip install sinv_prune" not in body  # no such package on PyPI
    assert 'AutoTokenizer.from_pretrained("tester/gpt2-pruned")' in body
    assert f"sinv_prune {sinv_prune.__version__}" in body


def test_the_token_never_appears_in_output_logs_or_uploads(pushed):
    assert pushed.logs, "nothing was logged: the capture is broken"
    assert "HTTP Request: POST" in pushed.logs or "/commit/" in pushed.logs
    assert TOKEN not in pushed.result.output
    assert TOKEN not in pushed.logs
    for name, data in pushed.received.items():
        assert TOKEN.encode() not in data, name


# -- the API: stock layout, existing repo, LFS, branch ---------------------------------------------


def test_push_pruned_replaces_an_existing_repo_with_overwrite(hub, llama_dir, tmp_path, worker_in_process):
    stale = {"modeling_sinv_prune.py": b"stale", "model.safetensors": b"stale", "pytorch_model.bin": b"stale",
             "README.md": b"old card"}  # fmt: skip
    hub.add_repo("tester/llama-pruned", stale)
    hub.lfs_patterns = ("*.safetensors",)  # as the real Hub's .gitattributes: weights go through LFS
    result = push_pruned(llama_dir.path, "llama-pruned", overwrite=True, revision="v1")  # token from HF_TOKEN

    assert result.repo_id == "tester/llama-pruned" and result.revision == "v1" and not result.created
    assert result.deleted == ["modeling_sinv_prune.py", "pytorch_model.bin"]
    assert result.reload_route == "LlamaForCausalLM.from_pretrained"
    files = hub.files("tester/llama-pruned", "v1")
    on_disk = {p.name for p in llama_dir.path.iterdir()}
    assert set(files) == on_disk | {"README.md", ".gitattributes"}
    assert hub.files("tester/llama-pruned", "main") == {".gitattributes": files[".gitattributes"], **stale}
    assert any(method == "PUT" and path.startswith("/_lfs/") for method, path in hub.requests)

    local = hub.write("tester/llama-pruned", tmp_path / "download", revision="v1")
    stock = transformers.LlamaForCausalLM.from_pretrained(local, attn_implementation="eager")  # no sinv_prune code
    torch.testing.assert_close(model_output(stock, model_inputs()), model_output(llama_dir.model, model_inputs()))

    _, body = card_parts(files["README.md"].decode())
    assert "trust_remote_code" not in body and "no extra package or remote code is needed" in body
    assert "not recorded" in body and "no run results were attached" in body  # a plain directory: record only
    before = count_parameters(tiny_model("llama"))
    assert f"{before:,} before, {count_parameters(llama_dir.model):,} after" in body
    assert "| 0 | 4 | 0, 3 |" in body


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_repo_created_after_the_check_is_not_overwritten_silently(hub, llama_dir, monkeypatch, worker_in_process,
                                                                    overwrite):  # fmt: skip
    """Someone creates the repo between the existence check and ours: refuse, or with overwrite replace its files."""
    theirs = {"model.safetensors": b"their weights", "pytorch_model.bin": b"their old weights"}
    real_check = hub_mod._check_hub

    def check_then_race(api, repo_id, timeout):
        found = real_check(api, repo_id, timeout)
        hub.add_repo("tester/raced", theirs)
        return found

    monkeypatch.setattr(hub_mod, "_check_hub", check_then_race)
    if not overwrite:
        with pytest.raises(PushError, match="tester/raced already exists on the Hub; pass --overwrite"):
            push_pruned(llama_dir.path, "tester/raced", model=llama_dir.model)
        assert hub.files("tester/raced") == {".gitattributes": hub.files("tester/raced")[".gitattributes"], **theirs}
        assert not hub.received
        return
    result = push_pruned(llama_dir.path, "tester/raced", model=llama_dir.model, overwrite=True)
    assert not result.created and result.deleted == ["pytorch_model.bin"]
    on_disk = {p.name for p in llama_dir.path.iterdir()}
    assert set(hub.files("tester/raced")) == on_disk | {"README.md", ".gitattributes"}


def test_a_token_in_the_card_text_is_scrubbed(hub, llama_dir, worker_in_process):
    recipe = f"# pushed with HF_TOKEN={TOKEN}\nname: leaky\nmodel: {{path: HuggingFaceTB/SmolLM2-135M}}\n"
    push_pruned(llama_dir.path, "tester/card", model=llama_dir.model, recipe_text=recipe)
    card = hub.received["tester/card"]["README.md"].decode()
    assert "name: leaky" in card and "HF_TOKEN=***" in card and TOKEN not in card


def test_a_checkpoint_that_reloads_differently_is_not_uploaded(hub, llama_dir, tmp_path, worker_in_process):
    broken = tmp_path / "checkpoint"
    shutil.copytree(llama_dir.path, broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.1.mlp.up_proj.weight"] += 0.5  # saved weights no longer match the model in memory
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(PushError, match="reload check failed: LlamaForCausalLM.*different outputs") as info:
        push_pruned(broken, "tester/broken", model=llama_dir.model)
    assert "\n" not in str(info.value) and "nothing was uploaded" in str(info.value)
    assert "tester/broken" not in hub.repos and not hub.received


# -- failures: one line, exit code 2, nothing uploaded, no token ----------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def no_token(hub, mp):
    mp.delenv("HF_TOKEN")


def wrong_token(hub, mp):
    mp.setenv("HF_TOKEN", WRONG)


def server_401(hub, mp):
    hub.fail_with = 401


def server_403(hub, mp):
    hub.fail_with = 403


def server_down(hub, mp):
    mp.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{free_port()}")


def repo_exists(hub, mp):
    hub.add_repo("tester/target")


def read_only_token(hub, mp):
    hub.role = "read"


def public_repo_asked_private(hub, mp):
    hub.add_repo("tester/target")
    return ["--overwrite", "--private"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (no_token, "no Hugging Face token: set HF_TOKEN or run `hf auth login`"),
        (wrong_token, "the Hub rejected the token (HTTP 401)"),
        (server_401, "the Hub rejected the token (HTTP 401)"),
        (server_403, "the token may not write to tester/target (HTTP 403)"),
        (server_down, "cannot reach the Hub at http://127.0.0.1:"),
        (repo_exists, "tester/target already exists on the Hub; pass --overwrite"),
        (read_only_token, "the token is read-only"),
        (public_repo_asked_private, "tester/target exists and is public"),
    ],
)
def test_push_failures_give_one_line_and_exit_2(hub, run_dir, monkeypatch, setup, message):
    extra = setup(hub, monkeypatch) or []
    before = set(hub.repos)
    result = CliRunner().invoke(main, ["push", str(run_dir.arm), "--repo-id", "tester/target", *extra])
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and result.output.rstrip().endswith(errors[0]), result.output
    assert message in errors[0], errors[0]
    assert TOKEN not in result.output and WRONG not in result.output
    assert set(hub.repos) == before and not hub.received and "reload" not in result.output


def test_a_hub_that_never_answers_times_out(run_dir, monkeypatch):
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{silent.getsockname()[1]}")
        with pytest.raises(PushError, match="did not answer in time"):
            push_pruned(run_dir.arm / "finetuned", "tester/target", timeout=0.5)


def test_cli_reload_mismatch_exits_2(hub, run_dir, monkeypatch):
    def fresh_but_different(model_dir, route, cls, ids, **_):
        model = sinv_prune.from_pretrained(model_dir, attn_implementation="eager")
        with torch.no_grad():
            return model(input_ids=ids).logits + 1.0

    monkeypatch.setattr(hub_mod, "_fresh_outputs", fresh_but_different)
    result = CliRunner().invoke(main, ["push", str(run_dir.root / ARM), "--repo-id", "tester/target"])
    assert result.exit_code == 2
    assert result.output.rstrip().splitlines()[-1].startswith("error: reload check failed: AutoModelForCausalLM")
    assert not hub.repos and not hub.received


def test_token_is_scrubbed_from_errors_that_quote_it():
    """The token in use, other Hub-token-shaped strings and whatever follows ``Bearer`` all go."""
    with pytest.raises(PushError) as info, hub_errors(ODD, "http://hub", "a/b"):
        raise RuntimeError(f"request with {ODD} failed (Authorization: Bearer jwt.x.y and old {WRONG})\nsecond line")
    message = str(info.value)
    assert message == "push to a/b failed: request with *** failed (Authorization: Bearer *** and old ***)"


def leaked(token: str, *texts: str, run: Path | None = None) -> list[str]:
    """Where ``token`` shows up: the indices of ``texts`` that hold it, and files under ``run`` that do."""
    found = [f"text {i}" for i, text in enumerate(texts) if token in text]
    files = [p for p in run.rglob("*") if p.is_file()] if run is not None else []
    return found + [str(p) for p in files if token.encode() in p.read_bytes()]


@pytest.mark.parametrize(
    ("token", "status", "server_says"),
    [
        (TOKEN, 403, "Forbidden: the request had Authorization: {authorization}"),
        (ODD, 500, "internal error while checking the token {token}"),
        (ODD, 401, "Invalid credentials: {token}"),
    ],
)
def test_a_hub_error_quoting_the_token_does_not_leak_it(hub, run_dir, monkeypatch, caplog, token, status, server_says):
    monkeypatch.setenv("HF_TOKEN", token)
    hub.fail_with, hub.fail_message = status, server_says
    caplog.set_level(logging.INFO)  # httpcore's DEBUG lines quote response headers verbatim, echoed token and all
    caplog.set_level(logging.DEBUG, logger="sinv_prune")
    result = CliRunner().invoke(main, ["push", str(run_dir.root / ARM), "--repo-id", "tester/target"])
    assert result.exit_code == 2, result.output
    error = result.output.rstrip().splitlines()[-1]
    assert error.startswith("error: ") and f"HTTP {status}" in error and "***" in error  # the quote got through
    assert not leaked(token, result.output, caplog.text, run=run_dir.root)


@pytest.mark.parametrize("token", [TOKEN, ODD])
def test_debug_http_logs_do_not_leak_the_token(hub, run_dir, monkeypatch, caplog, token):
    """At DEBUG, httpcore quotes response headers (the server's echo of the token) and HF_DEBUG
    prints each request as a curl command: every record is scrubbed when it is made."""
    monkeypatch.setenv("HF_TOKEN", token)
    monkeypatch.setattr(constants, "HF_DEBUG", True)
    hub.fail_with, hub.fail_message = 403, "Forbidden: the request had Authorization: {authorization}"
    caplog.set_level(logging.DEBUG)
    for name in ("httpcore2", "httpx2", "httpcore", "httpx", "urllib3", "huggingface_hub", "sinv_prune"):
        caplog.set_level(logging.DEBUG, logger=name)
    result = CliRunner().invoke(main, ["push", str(run_dir.root / ARM), "--repo-id", "tester/target"])
    assert result.exit_code == 2, result.output
    assert "receive_response_headers" in caplog.text or "Request" in caplog.text, "no HTTP debug lines captured"
    assert not leaked(token, result.output, caplog.text, run=run_dir.root)
    assert logging.getLogRecordFactory() is logging.LogRecord  # the scrubber is gone after the push


def test_a_token_lookup_error_is_scrubbed(monkeypatch):
    secret = "hf_" + "Q7" * 17  # token-shaped, not the token in use
    jwt = "eyJhbGciOiJSUzI1NiJ9.eyJzdWIiOiJ0ZXN0ZXIifQ.c2lnbmF0dXJl"

    def fail():
        raise RuntimeError(f"OIDC exchange of {jwt} failed; cached token {secret} expired")

    monkeypatch.setattr(huggingface_hub, "get_token", fail)
    with pytest.raises(PushError) as info:
        hub_mod.resolve_token(None)
    message = str(info.value)
    assert message.startswith("could not get a Hugging Face token") and "***" in message
    assert secret not in message and jwt not in message and "eyJ" not in message


def test_an_upload_error_quoting_the_token_does_not_leak_it(hub, run_dir, tmp_path, monkeypatch, caplog,
                                                            worker_in_process):  # fmt: skip
    """The recipe's push stage: the upload client fails after the reload check, quoting the token."""
    from sinv_prune.pipeline.stages import Run, RunStageError, _log_to_file, stage_push
    from sinv_prune.rundir import RunDir

    def fail(*args, **kwargs):
        raise OSError(f"upload rejected for {ODD}, Authorization: Bearer {ODD}\nretry later")

    monkeypatch.setenv("HF_TOKEN", ODD)
    monkeypatch.setattr(huggingface_hub.HfApi, "create_commit", fail)
    monkeypatch.setattr(hub, "token", ODD)
    root = shutil.copytree(run_dir.root, tmp_path / "run")
    recipe = yaml.safe_load((root / "recipe.yaml").read_text())
    recipe["push"] = {"repo_id": "tester/tiny-{arm}"}
    run = Run(validate_recipe(recipe), RunDir(root), "cpu", quiet=True)
    run.dir.state = json.loads((root / "state.json").read_text())
    caplog.set_level(logging.DEBUG)
    handler = _log_to_file(root / "run.log")
    try:
        with pytest.raises(RunStageError) as info:
            stage_push(run, run_dir.results)
    finally:
        logging.getLogger("sinv_prune").removeHandler(handler)
        logging.getLogger("transformers").removeHandler(handler)
        handler.close()
    message = str(info.value)
    assert message == f"push: push to tester/tiny-{ARM} failed: upload rejected for ***, Authorization: Bearer ***"
    assert "reload check passed" in (root / "run.log").read_text()  # the log was written
    assert not leaked(ODD, message, caplog.text, run=root)
    assert "pushed" not in run.dir.state["arms"][ARM]


# -- model.push_to_hub (transformers' own route) -------------------------------------------------


@pytest.mark.parametrize(("arch", "removed"), [("gpt2", GPT2_REMOVED), ("llama", LLAMA_REMOVED)])
def test_model_push_to_hub_uploads_a_checkpoint_that_reloads(hub, tmp_path, arch, removed):
    model = tiny_model(arch)
    sinv_prune.prune_heads(model, removed)
    model.push_to_hub(f"tester/{arch}-api")  # the token comes from HF_TOKEN
    received = hub.received[f"tester/{arch}-api"]
    config = json.loads(received["config.json"])
    assert config["sinv_prune"]["pruned_heads"]
    if arch == "gpt2":  # remote code: the shim travels with the checkpoint
        assert "modeling_sinv_prune.py" in received
        assert (
            received["modeling_sinv_prune.py"]
            == Path(sinv_prune.__file__).with_name("modeling_sinv_prune.py").read_bytes()
        )
        assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_sinv_prune.SinvPrunedGPT2LMHeadModel"
    else:  # stock layout: nothing but the stock files
        assert "modeling_sinv_prune.py" not in received and "auto_map" not in config
    local = hub.write(f"tester/{arch}-api", tmp_path / "download")
    reloaded = sinv_prune.from_pretrained(local, attn_implementation="eager")
    torch.testing.assert_close(model_output(reloaded, model_inputs()), model_output(model, model_inputs()))


# -- where SOURCE points, and cards without a run ---------------------------------------------------


def test_source_can_be_an_arm_name_an_arm_dir_or_a_model_dir(run_dir):
    by_name = resolve_source(run_dir.root / ARM)
    assert by_name.model_dir == run_dir.arm / "finetuned" and by_name.arm == ARM and by_name.stage == "finetuned"
    assert by_name.results == run_dir.results and "taylor" in by_name.recipe_text
    assert resolve_source(run_dir.arm).model_dir == run_dir.arm / "finetuned"
    pruned = resolve_source(run_dir.arm / "pruned")
    assert (pruned.model_dir, pruned.arm, pruned.stage) == (run_dir.arm / "pruned", ARM, "pruned")
    with pytest.raises(PushError, match=f"is a run directory; name an arm: .*arms: {ARM}"):
        resolve_source(run_dir.root)
    with pytest.raises(PushError, match=f"has no arm 'nope' \\(arms: {ARM}\\)"):
        resolve_source(run_dir.root / "nope")


def test_a_directory_holding_checkpoints_names_them(tmp_path):
    """``bench_shrink.py --save DIR`` writes DIR/shrink-<cut>: naming DIR says which checkpoints lie inside."""
    for name in ("shrink-0.25", "shrink-0.1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    inside = r"not a checkpoint directory.*; checkpoints inside it: shrink-0\.1, shrink-0\.25$"
    with pytest.raises(PushError, match=inside):
        resolve_source(tmp_path)
    with pytest.raises(PushError, match=r"or RUN/ARM_NAME$"):
        resolve_source(tmp_path / "notes")


def test_card_of_a_pruned_hub_model_names_its_base_and_data(run_dir):
    recipe = "model: {path: HuggingFaceTB/SmolLM2-135M}\ndata: {hub: {path: wikitext, name: wikitext-2-raw-v1}}\n"
    config = transformers.AutoConfig.from_pretrained(run_dir.arm / "pruned")
    text = model_card(config, repo_id="me/smol", results=run_dir.results, arm=ARM, stage="pruned", recipe_text=recipe)
    meta, body = card_parts(text)
    assert meta["base_model"] == "HuggingFaceTB/SmolLM2-135M" and meta["datasets"] == ["wikitext"]
    assert "[HuggingFaceTB/SmolLM2-135M](https://huggingface.co/HuggingFaceTB/SmolLM2-135M)" in body
    assert "Hub data set `wikitext` (`wikitext-2-raw-v1`)" in body
    assert "| pruned **(this checkpoint)** |" in body and "pruned, not fine-tuned" in body


def test_card_shows_the_zero_shot_task_scores_beside_perplexity(run_dir):
    results = copy.deepcopy(run_dir.results)
    arm = next(a for a in results["arms"] if a["name"] == ARM)
    results["baseline"]["tasks"] = {"wikitext_lastword": {"acc": 0.26, "acc_stderr": 0.031, "perplexity": 54.0}}
    arm["pruned"]["tasks"] = {"wikitext_lastword": {"acc": 0.19, "acc_stderr": 0.028}}
    results["run"]["lm_eval"] = {"lm_eval_version": "0.4.9", "num_fewshot": 0, "limit": 200, "batch_size": 8,
                                 "bootstrap_iters": 1000, "tasks": {"wikitext_lastword": {"version": 1.0}}}  # fmt: skip
    config = transformers.AutoConfig.from_pretrained(run_dir.arm / "pruned")
    _, body = card_parts(model_card(config, repo_id="me/x", results=results, arm=ARM, stage="pruned"))
    assert "| model | parameters | perplexity | wikitext_lastword (acc) |" in body
    assert "| 0.2600 ± 0.0310 |" in body and "| 0.1900 ± 0.0280 |" in body
    assert "lm-eval 0.4.9, 0-shot, limit 200 items per task" in body
    _, plain = card_parts(model_card(config, repo_id="me/x", results=run_dir.results, arm=ARM, stage="pruned"))
    assert "(acc)" not in plain and "lm-eval" not in plain


def test_card_of_an_unpruned_model_says_so():
    config = tiny_model("bert").config
    config.architectures = ["BertForMaskedLM"]  # as save_pretrained writes it
    meta, body = card_parts(model_card(config, repo_id="me/bert"))
    assert meta["tags"] == ["sinv-prune"] and meta["pipeline_tag"] == "fill-mask"
    assert "not pruned" in body and "AutoModelForMaskedLM" in body and "trust_remote_code" not in body


def test_recipe_push_stage_pushes_each_arm_once(hub, run_dir, worker_in_process):
    """The pipeline's push stage: repo id per arm, recorded in state.json, skipped when done."""
    from sinv_prune.pipeline.stages import Run, stage_push
    from sinv_prune.rundir import RunDir

    recipe = yaml.safe_load((run_dir.root / "recipe.yaml").read_text())
    recipe["push"] = {"repo_id": "tester/tiny-{arm}", "private": True}
    run = Run(validate_recipe(recipe), RunDir(run_dir.root), "cpu", quiet=True)
    run.dir.state = json.loads((run_dir.root / "state.json").read_text())
    stage_push(run, run_dir.results)
    repo = f"tester/tiny-{ARM}"
    assert "README.md" in hub.files(repo) and "model.safetensors" in hub.files(repo)
    assert run.dir.state["arms"][ARM]["pushed"].endswith(repo)
    assert "push" in json.loads((run_dir.root / "state.json").read_text())["finished"]
    hub.repos.clear()
    stage_push(run, run_dir.results)  # finished: nothing is pushed again
    assert not hub.repos


def test_push_spec_needs_an_arm_placeholder_for_several_arms():
    from sinv_prune.pipeline.recipe import RecipeError

    data = {
        "model": {"path": "x/y"}, "data": {"synthetic": {}},
        "prune": {"arms": [{"criterion": "random", "amount": 1}, {"criterion": "magnitude", "amount": 1}]},
        "push": {"repo_id": "me/model"},
    }  # fmt: skip
    with pytest.raises(RecipeError, match=r"push.repo_id: several arms"):
        validate_recipe(data)
    data["push"] = {"repo_id": "me/{arm}", "arms": ["nope"]}
    with pytest.raises(RecipeError, match=r"push.arms: unknown arms \['nope'\]"):
        validate_recipe(data)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_compensated_symmetry_broken_checkpoint_passes_the_fresh_process_reload_check(hub, tmp_path, arch):
    """Recovery and symmetry breaking change only weights and config: the push route is the same."""
    model = tiny_model(arch)
    sinv_prune.add_symmetry_breaking(model, seed=0)
    heads = {0: [1], 2: [0, 3]} if arch == "gpt2" else {layer: [0, 3] for layer in range(3)}
    batches = [model_inputs(seed=s) for s in range(3)]
    summary = sinv_prune.prune_heads(model, heads, calibration=batches, compensate="lsq")
    assert summary.compensation is not None
    model.save_pretrained(tmp_path / "ckpt")
    result = push_pruned(tmp_path / "ckpt", f"{arch}-recovered")  # reload check in a real fresh process
    assert result.reload_route and "model.safetensors" in hub.files(f"tester/{arch}-recovered", "main")
