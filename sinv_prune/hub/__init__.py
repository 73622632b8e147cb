"""Publishing pruned models: push with a reload check, model cards."""
