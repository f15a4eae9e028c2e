"""``python -m llama_megatron VERB ...`` = ``llama-megatron VERB ...``."""

from llama_megatron.cli import entry_point

entry_point()
