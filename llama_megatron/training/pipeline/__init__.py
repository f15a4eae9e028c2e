"""Pipeline-parallel schedules (1F1B and zero-bubble ZB-H1) and their per-rank timeline."""
