"""Processes that wait for the main one outlast torch's default collective timeout (SINV_PRUNE_DDP_TIMEOUT)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sinv_prune.pipeline.ranks import TIMEOUT_S, timeout_s
from sinv_prune.pipeline.recipe import RecipeError

REPO = Path(__file__).resolve().parents[1]

# torch's default (30 minutes for gloo) shortened to 3 s, so a 6 s stage on the main process outlasts it
SCRIPT = """
import datetime, time
import torch.distributed.distributed_c10d as c10d
c10d.default_pg_timeout = datetime.timedelta(seconds=3)
from sinv_prune.pipeline.ranks import Ranks
ranks = Ranks("cpu")
try:
    print("rank", ranks._state.process_index, ranks.on_main(lambda: (time.sleep(6), "waited")[1]), flush=True)
except RuntimeError as err:
    print("rank", ranks._state.process_index, "failed:", str(err)[:120], flush=True)
"""


def launch(tmp_path: Path, **env: str) -> str:
    script = tmp_path / "stage.py"
    script.write_text(SCRIPT)
    path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    environ = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **env}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


@pytest.mark.slow
def test_a_long_main_only_stage_outlasts_the_default_timeout_and_the_variable_sets_it(tmp_path):
    out = launch(tmp_path)
    assert "rank 0 waited" in out and "rank 1 waited" in out, out[-3000:]
    short = launch(tmp_path, SINV_PRUNE_DDP_TIMEOUT="2")  # the variable is what the waiting rank gets
    assert "rank 1 failed: " in short and "Timed out" in short, short[-3000:]


def test_the_timeout_variable_is_checked(monkeypatch):
    monkeypatch.delenv("SINV_PRUNE_DDP_TIMEOUT", raising=False)
    assert timeout_s() == TIMEOUT_S == 86400
    monkeypatch.setenv("SINV_PRUNE_DDP_TIMEOUT", "7200")
    assert timeout_s() == 7200
    for bad in ("0", "-5", "two hours"):
        monkeypatch.setenv("SINV_PRUNE_DDP_TIMEOUT", bad)
        with pytest.raises(RecipeError, match=rf"^SINV_PRUNE_DDP_TIMEOUT: '{bad}' is not a positive number of"):
            timeout_s()
