"""Modeling code shipped with pruned checkpoints through ``auto_map``.

Kept thin on purpose: ``AutoModel*.from_pretrained(..., trust_remote_code=True)``
imports this file from the checkpoint, and it defers to the installed
``sinv_prune`` package (installed from a clone: ``pip install .``; see README), the one source of truth.
Classes are named ``SinvPruned<TransformersClass>``.
"""

from sinv_prune.surgery.checkpoint import class_by_name


def __getattr__(name):
    return class_by_name(name, __name__)
