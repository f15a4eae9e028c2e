"""``python -m llama_megatron.train`` = ``llama-megatron train``: the module form launchers are given
(``deepspeed --module llama_megatron.train``, as Megatron users write ``pretrain_gpt.py``)."""

import sys

from llama_megatron.commands.train import main

if __name__ == "__main__":
    sys.exit(main())
