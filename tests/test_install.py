"""README's minimal install (``pip install .`` in a clone, no extras) on a fresh virtual environment.

The tests themselves run in a virtual environment (CI's ``.venv``), and a venv made from a venv sees the
base interpreter's site-packages, not this one's, even with ``--system-site-packages``. So the new venv
gets one ``.pth`` line naming a directory of links to the installed distributions the minimal install
needs: sinv_prune's dependencies without extras, what they need in turn, setuptools to build it and
pip (the venv is made ``--without-pip``: Python 3.11's own would bring an old setuptools). pip then
resolves every dependency from those with ``--no-index`` (nothing is downloaded; a dependency the
closure lacks fails the install) and ``--no-build-isolation``. The extras (lm-eval,
llama-cpp-python, pytest) are not linked, so a command that imported one at start would fail here.
The package is built from a copy of the checkout's tracked files, so nothing (``build/``,
``*.egg-info``) is written into the checkout.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import model_inputs, model_output, tiny_model
from packaging.requirements import Requirement

import sinv_prune

ROOT = Path(__file__).resolve().parents[1]
BUILD_REQUIREMENTS = ["setuptools"]  # pyproject's [build-system] (checked below)
TOOLS = ["pip"]  # the venv is made without its own (Python 3.11's ensurepip adds an old setuptools)


def readme_minimal_install() -> list[str]:
    """README's install command without extras, as arguments after ``pip``: of every ``pip install`` in it
    (code blocks and inline code), the one that names no extra, torch, git URL or ``--no-deps`` package."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = {c.strip() for c in re.findall(r"pip install [^`\n#&]*", text)}
    (minimal,) = [c for c in commands if not any(s in c for s in ("[", "torch", "git+", "--no-deps"))]
    return shlex.split(minimal)[1:]


def dependency_closure(requirements: list[str]) -> list[importlib.metadata.Distribution]:
    """The installed distributions ``requirements`` need, with theirs in turn (markers evaluated, a
    dependency's extras followed where a requirement asks for them: ``fsspec[http]``)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    followed: set[tuple[str, str]] = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = re.sub(r"[-_.]+", "-", req.name).lower()
        if name not in found:  # PackageNotFoundError: the environment lacks a dependency
            found[name] = importlib.metadata.distribution(req.name)
        for wanted in ("", *sorted(req.extras)):
            if (name, wanted) not in followed:
                followed.add((name, wanted))
                todo += [(Requirement(r), wanted) for r in found[name].requires or []]
    return list(found.values())


def link_distributions(dists, target: Path) -> None:
    """Links in ``target`` to every top-level package, module and metadata folder of ``dists``."""
    target.mkdir()
    for dist in dists:
        tops = {Path(f).parts[0] for f in dist.files or []}
        for top in sorted(tops):
            if top == ".." or top.endswith(".pth") or top == "__pycache__" or (target / top).exists():
                continue
            source = Path(dist.locate_file(top))
            if source.exists():
                (target / top).symlink_to(source, target_is_directory=source.is_dir())


def copy_checkout(target: Path) -> Path:
    """The checkout's tracked files (working-tree content) in ``target``, as a clone would have them."""
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
        names = [n for n in listed.stdout.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
    if not names:  # not a git checkout: everything but caches, environments and build outputs
        ignore = shutil.ignore_patterns(".git", ".venv", "__pycache__", "build", "*.egg-info", "runs")
        shutil.copytree(ROOT, target, ignore=ignore)
        return target
    for name in names:
        if (ROOT / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, target / name)
    return target


def run(cmd: list, env: dict, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
    return proc


@pytest.mark.slow
def test_readme_minimal_install_gives_a_working_cli_in_a_fresh_venv(tmp_path):
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert [Requirement(r).name for r in pyproject["build-system"]["requires"]] == BUILD_REQUIREMENTS
    before = sorted(p.name for p in ROOT.iterdir())
    args = readme_minimal_install()  # run in the clone, as README says

    deps = tmp_path / "deps"
    link_distributions(dependency_closure(pyproject["project"]["dependencies"] + BUILD_REQUIREMENTS + TOOLS), deps)
    assert not (deps / "lm_eval").exists() and not (deps / "llama_cpp").exists()  # the extras stay out
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "PIP_", "VIRTUAL_ENV"))}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", venv], env, tmp_path)
    python = venv / "bin" / "python"
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], env, tmp_path).stdout
    (Path(site.strip()) / "sinv_prune_test_deps.pth").write_text(f"{deps}\n")

    source = copy_checkout(tmp_path / "clone")
    run([python, "-m", "pip", *args, "--no-index", "--no-build-isolation", "--no-cache-dir", "-q"], env, source)
    found = run([python, "-c", "import importlib.util as u; print(u.find_spec('sinv_prune').origin, "
                 "u.find_spec('lm_eval'), u.find_spec('llama_cpp'))"], env, tmp_path).stdout.split()  # fmt: skip
    assert Path(found[0]).is_relative_to(venv) and found[1:] == ["None", "None"]  # installed, not the checkout

    cli = venv / "bin" / "sinv-prune"
    assert "sinv-prune shrink MODEL OUT" in run([cli, "--help"], env, tmp_path).stdout
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "model")
    run([cli, "prune", tmp_path / "model", tmp_path / "pruned", "--heads", "0:1,4;2:0,3"], env, tmp_path)
    sinv_prune.prune_heads(model, {0: [1, 4], 2: [0, 3]})  # the same cut here, in memory
    reloaded = sinv_prune.from_pretrained(tmp_path / "pruned")
    assert reloaded.config.sinv_prune["pruned_heads"] == {"0": [1, 4], "2": [0, 3]}
    torch.testing.assert_close(model_output(reloaded, model_inputs()), model_output(model, model_inputs()))
    assert sorted(p.name for p in ROOT.iterdir()) == before  # no build/ or *.egg-info in the checkout
