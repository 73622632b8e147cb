"""Convergence tracking during training: a ``TrainerCallback``, the paper's stopping rule, head freezing.

The NN6 paper stops training "when all measures fall below 0.05" and freezes heads that
have converged. This module measures :func:`sinv_prune.scoring.measures.head_measures` every
``every_n_steps`` optimizer steps (and at each epoch end), appends each measurement to a
JSON-lines trace (:mod:`sinv_prune.scoring.trace`), puts summary scalars into the Trainer's logs,
and, on request, stops training or freezes converged heads.

* :func:`stop_rule` -- the rule on one measurement record: every value of every chosen
  measure is below the threshold (``None`` values are ignored).
* :func:`track` -- measure, append to a trace, return the record (for custom loops).
* :class:`HeadFreezer` -- keeps chosen heads' Q/K/V/O slices fixed during training.
* :class:`ConvergenceCallback` -- all of the above inside ``transformers.Trainer``.

Measured values so far (SmolLM2-135M: C_Q 0.55-0.92; a tiny GPT-2 after 600 steps:
0.65-0.74; random init ~0.71) are far from 0.05, so the rule usually never fires: the
callback then writes a ``stop_rule_not_fired`` note telling how close the run came.
"""

from sinv_prune.pipeline.tracking.callback import ConvergenceCallback
from sinv_prune.pipeline.tracking.freezer import HeadFreezer
from sinv_prune.pipeline.tracking.rule import (
    DEFAULT_EVERY_N_STEPS,
    DEFAULT_RULE_MEASURES,
    DEFAULT_THRESHOLD,
    DEFAULT_TRACE_NAME,
    OVERHEAD_WARNING,
    log_scalars,
    rule_max,
    stop_rule,
    track,
)

__all__ = [
    "DEFAULT_EVERY_N_STEPS",
    "DEFAULT_RULE_MEASURES",
    "DEFAULT_THRESHOLD",
    "DEFAULT_TRACE_NAME",
    "OVERHEAD_WARNING",
    "ConvergenceCallback",
    "HeadFreezer",
    "log_scalars",
    "rule_max",
    "stop_rule",
    "track",
]
