"""Process groups, autograd-aware collectives and tensor-parallel layers (import the modules: the package imports
nothing, so its torch-free modules, placement and degrees, load without torch)."""
