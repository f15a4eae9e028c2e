"""The DeepSpeed engine of a run: its JSON, optimizer, LR schedule, the MoE-aware and pipeline engines, and the one interface over them."""
