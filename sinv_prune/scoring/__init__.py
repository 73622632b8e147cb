"""What to remove: the papers' measures, criteria, gates, selection and the pruner object."""
