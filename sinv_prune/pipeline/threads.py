"""How many CPU threads torch should use for a run (``--threads auto``, the default).

torch starts one intra-op thread per core. For small models each operation is too small to
split, and on a machine whose cores are busy the threads wait on each other: the quickstart
(237k parameters) took 15 min on a 2-core machine with torch's default and under 2 min on one
thread. ``choose_threads`` picks the count from the model's size and the cores really free.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("sinv_prune")

# One thread per this many parameters: below it an op's work is smaller than the cost of
# splitting it across threads (a heuristic; 10M parameters is about hidden size 256-384).
PARAMS_PER_THREAD = 10_000_000


@dataclass(frozen=True)
class ThreadChoice:
    """The thread count for torch and why it was chosen (logged once per run)."""

    threads: int
    reason: str


def parse_threads(value: int | str | None) -> int | str | None:
    """``"auto"``, a positive integer (or its text), or None; ValueError naming the value otherwise."""
    if value is None or value == "auto":
        return value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"threads: expected 'auto' or a positive integer, got {value!r}")
    return value


def usable_cores() -> int:
    """CPUs this process may run on: its affinity set, lowered by a cgroup CPU quota if any."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = _cgroup_cpu_quota()
    return max(1, min(cores, quota) if quota else cores)


def _cgroup_cpu_quota() -> int | None:
    """``cpu.max`` of cgroup v2 (``"200000 100000"`` -> 2 CPUs); None without a quota."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        return None


def load_average() -> float | None:
    """The 1-minute load average (runnable processes), or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def choose_threads(
    requested: int | str | None = "auto",
    *,
    n_params: int | None,
    cores: int | None = None,
    load: float | None = None,
) -> ThreadChoice:
    """The torch thread count for a model of ``n_params`` non-embedding parameters on this machine.

    An integer ``requested`` is used as given. ``"auto"``: one thread per
    ``PARAMS_PER_THREAD`` parameters (at least one), at most the free cores: ``cores``
    (default :func:`usable_cores`) minus the running ``load`` (default :func:`load_average`),
    rounded, at least one. An unknown model size gets the free cores.
    """
    requested = parse_threads(requested)
    if isinstance(requested, int):
        return ThreadChoice(requested, f"--threads {requested}")
    cores = usable_cores() if cores is None else cores
    load = load_average() if load is None else load
    free = max(1, min(cores, math.floor(cores - (load or 0.0) + 0.5)))
    machine = f"{cores} usable CPUs, load {load:.2f} -> {free} free" if load is not None else f"{cores} usable CPUs"
    if n_params is None:
        return ThreadChoice(free, f"auto: model size unknown; {machine}")
    by_size = max(1, n_params // PARAMS_PER_THREAD)
    size = f"{n_params:,} non-embedding parameters -> {by_size} (one per {PARAMS_PER_THREAD:,})"
    return ThreadChoice(min(by_size, free), f"auto: {size}; {machine}")


def recipe_params(recipe) -> int | None:
    """Non-embedding parameters of the recipe's starting model, built on the meta device; None if unknown.

    Embedding lookups cost no arithmetic, so they do not count towards the work per op.
    """
    import torch
    import transformers
    from torch import nn

    from sinv_prune.pipeline.recipe import RecipeError
    from sinv_prune.pipeline.starting_model import starting_config

    try:
        config, _ = starting_config(recipe)  # cached: a GGUF config takes seconds to read
        with torch.device("meta"):
            model = transformers.AutoModel.from_config(config)
    except (OSError, ValueError, TypeError, KeyError, RecipeError):
        return None
    embedded = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in embedded)


def recipe_threads(recipe, threads: int | str | None) -> contextlib.AbstractContextManager:
    """The torch-thread context a run of ``recipe`` uses: ``"auto"``, a count, or None (torch's own)."""
    if threads is None:
        return contextlib.nullcontext()
    n_params = recipe_params(recipe) if threads == "auto" else None
    return torch_threads(choose_threads(threads, n_params=n_params))


@contextmanager
def torch_threads(choice: ThreadChoice) -> Iterator[ThreadChoice]:
    """Use ``choice.threads`` torch threads inside the block, then restore the previous count.

    Also tries the inter-op pool (settable only before torch first uses it, so it is left as is
    otherwise and not restored) and, when one thread is chosen, turns off the Rust tokenizers'
    own thread pool (``TOKENIZERS_PARALLELISM``) unless the environment already sets it.
    """
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(choice.threads)
    with contextlib.suppress(RuntimeError):  # the pool has started; eager forward and backward leave it idle
        torch.set_num_interop_threads(choice.threads)
    added_env = choice.threads == 1 and "TOKENIZERS_PARALLELISM" not in os.environ
    if added_env:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    logger.info("torch threads: %d (%s)", choice.threads, choice.reason)
    try:
        yield choice
    finally:
        torch.set_num_threads(before)
        if added_env:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
