"""``scripts/compare_refactor.py`` on two of its cheap setups: the same digests twice, and a changed one named.

Runs the script's ``main(argv)`` in this process, as ``tests/test_benchmarks.py`` does for the benchmarks.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "compare_refactor.py"
SETUPS = ["plan-direct", "selection-gates"]


def _script():
    spec = importlib.util.spec_from_file_location("_test_compare_refactor", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_digests_repeat_and_a_difference_is_named(tmp_path, capsys):
    compare = _script()
    threads = torch.get_num_threads()
    first = tmp_path / "first.json"
    assert compare.main(["--only", *SETUPS, "--json", str(first)]) == 0
    assert torch.get_num_threads() == threads  # restored
    data = json.loads(first.read_text())
    assert list(data["setups"]) == SETUPS and len(data["combined"]) == 64
    for result in data["setups"].values():
        assert set(result["parts"]) == set(compare.PARTS) and result["params"] > 0
    out = capsys.readouterr().out
    assert f"combined digest (2 setups): {data['combined']}" in out
    assert compare.main(["--only", *SETUPS, "--against", str(first)]) == 0  # deterministic
    assert "same as" in capsys.readouterr().out
    data["setups"]["plan-direct"]["parts"]["weights"] = "0" * 64
    data["setups"]["plan-direct"]["digest"] = "0" * 64
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(data))
    assert compare.main(["--only", *SETUPS, "--against", str(changed)]) == 1
    out = capsys.readouterr().out
    assert "DIFFERS: weights" in out and out.splitlines()[-1].endswith(": plan-direct")
