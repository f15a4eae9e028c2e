"""Process groups, autograd-aware collectives and tensor-parallel layers."""

from llama_megatron.parallel.context import ParallelContext

__all__ = ["ParallelContext"]
