"""Load saved checkpoints in a fresh process and write their outputs; run by ``test_checkpoint.py``.

Usage: ``python reload_worker.py JOBS.json``. The file holds a list of jobs, each
``{"dir", "route", "inputs", "out"}``: load the checkpoint in ``dir`` through
``route``, run it on the inputs saved (``torch.save``) in ``inputs`` and write
``{"main", "class", "module", "missing", "unexpected", "mismatched", "sinv_prune_loaded"}``
to ``out`` with ``torch.save``.

Routes: ``sinv`` (``sinv_prune.from_pretrained``); ``auto:<AutoClass>`` (with
``trust_remote_code=True``); ``plain:<AutoClass>`` (no remote code); ``stock``
(the class named in ``config.architectures``, no remote code). Jobs that need no
``sinv_prune`` run first, so ``sinv_prune_loaded`` shows whether they pulled it in.
"""

from __future__ import annotations

import json
import sys

import torch
import transformers

NO_SINV = ("stock", "plain:")


def load(directory: str, route: str):
    kwargs = {"attn_implementation": "eager", "output_loading_info": True}
    if route == "sinv":
        import sinv_prune

        model = sinv_prune.from_pretrained(directory, attn_implementation="eager")
        return model, {}
    if route == "stock":
        config = transformers.AutoConfig.from_pretrained(directory)
        (name,) = config.architectures
        return getattr(transformers, name).from_pretrained(directory, **kwargs)
    kind, auto = route.split(":")
    return getattr(transformers, auto).from_pretrained(directory, trust_remote_code=kind == "auto", **kwargs)


def main(jobs_file: str) -> None:
    torch.set_num_threads(1)
    with open(jobs_file) as f:
        jobs = json.load(f)
    jobs.sort(key=lambda job: not job["route"].startswith(NO_SINV))
    for job in jobs:
        model, info = load(job["dir"], job["route"])
        model.eval()
        inputs = torch.load(job["inputs"], weights_only=True)
        with torch.no_grad():
            out = model(**inputs)
        main_out = out.logits if hasattr(out, "logits") else out.last_hidden_state
        torch.save(
            {
                "main": main_out,
                "class": type(model).__name__,
                "module": type(model).__module__,
                "missing": sorted(info.get("missing_keys", ())),
                "unexpected": sorted(info.get("unexpected_keys", ())),
                "mismatched": sorted(str(k) for k in info.get("mismatched_keys", ())),
                "sinv_prune_loaded": "sinv_prune" in sys.modules,
            },
            job["out"],
        )


if __name__ == "__main__":
    main(sys.argv[1])
