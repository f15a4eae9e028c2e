"""DeepSpeed's universal checkpoint for our models: the parameter patterns it needs, the conversion run before a
resume at another DP x CP or EP degree, and its expert-parallel variant."""
