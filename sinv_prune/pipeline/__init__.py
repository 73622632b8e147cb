"""The YAML recipe pipeline: spec, preflight, stages, training, evaluation, reports."""
