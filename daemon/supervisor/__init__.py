"""The supervisor loop and one trainer's life: scheduling, gangs of GPUs, exits, hangs, locks."""
