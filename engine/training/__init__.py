"""The pieces of a training step: adapters, optimizers, LR schedule, RNG, EMA, stop signals, held-out loss."""
