"""Physical removal of heads, MLP channels and layers; the pruning record; checkpoints; compensation."""
