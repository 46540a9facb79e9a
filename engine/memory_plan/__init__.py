"""The memory plan: how one attempt of a job spends the GPU memory it has.

This package owns
    budget.py   the bytes the plan may spend (the budget, in this order: $LORAD_VRAM_BUDGET_GB, which the daemon
                sets under `gpu_memory_policy: plan` to the VRAM it found free; else the job's resources.vram_gb;
                else the card's free memory (torch.cuda.mem_get_info) on CUDA; else no limit, on the CPU)
    costs.py    a model of the bytes each block takes per choice: its frozen weights resident or swapped, its
                activations kept, kept as attention outputs only (the rest recomputed) or recomputed whole
    choose.py   the pick: the cheapest plan whose estimate fits the budget; the job's explicit keys win
                (train.blocks_to_swap, train.gradient_checkpointing, train.compile)
    attempt.py  what the daemon asks of this attempt after an out-of-memory ($LORAD_MEMORY_PLAN: floors the
                plan may not go under, a smaller micro-batch) and the ladder of levers it walks (replan)
    apply.py    per-block activation checkpointing, selective (attention outputs kept) or whole
    setup.py    the plan at an attempt's set-up (engine/recipe.py): floors, micro-batch, load, plan, apply
    oom.py      an out-of-memory in words (what it needed), and the test hook that raises a real one

A plan is an input of the attempt, never of the job: it changes where bytes live and what is recomputed, not the
numerics, and none of it is in the job's identity (its config hash), so a job resumes under another plan and, on
the CPU, ends bit-identical. The one lever that changes arithmetic is a smaller micro-batch (same samples, same
effective batch, sums in another order); only the out-of-memory re-plan pulls it, last (docs/checkpoints.md).

Nothing is imported here: the daemon reads attempt.py (pydantic only) without torch.
"""
