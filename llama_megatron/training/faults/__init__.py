"""Fault handling in a run: the step guard, stop requests (signals, time budget, launcher gone) and the stall watchdog."""
