"""llama_megatron: Megatron-style parallel LLaMA on DeepSpeed."""

__version__ = "0.1.0"
