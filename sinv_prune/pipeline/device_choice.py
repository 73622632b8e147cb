"""Which device a run, an evaluation or a fine-tune uses when none is named, and waiting for it."""

from __future__ import annotations


def default_device(*named: str | None) -> str:
    """The first device in ``named`` that is set (a ``--device`` option, a recipe's ``device``, ...); else
    ``"cuda"`` where torch sees a GPU and ``"cpu"`` where it does not."""
    for device in named:
        if device:
            return device
    import torch  # here, not at the top: the CLI imports this module before it needs torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def synchronize(device) -> None:
    """Wait for the work queued on ``device`` (a GPU runs asynchronously; timings need its end); a no-op off CUDA."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
