"""Tools that inspect a run or a cluster: doctor, memory estimate, FLOP count, loss-curve plots."""
