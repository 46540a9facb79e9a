"""One job on several processes or machines: DDP, FSDP2 sharding, and per-rank liveness."""
