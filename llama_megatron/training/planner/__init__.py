"""``llama-megatron plan``: every parallel layout the engine runs for a model on a cluster, its memory (the memory
estimate's own code) and its step time (an analytic cost model on a device profile), ranked (docs/planner.md)."""
