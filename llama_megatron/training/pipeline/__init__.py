"""Pipeline-parallel schedules (1F1B, interleaved, zero-bubble) and their per-rank timeline."""
