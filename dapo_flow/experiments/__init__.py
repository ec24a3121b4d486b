"""What researchers do with runs: sweeps of graph variants (sweep), judging them (compare),
diffs between graphs (graphdiff) and evaluation of checkpoints (evaluate)."""
