"""``python -m llama_megatron.train`` = ``llama-megatron train``: the module form launchers are given
(``deepspeed --module llama_megatron.train``, as Megatron users write ``pretrain_gpt.py``)."""

from llama_megatron.commands.train import main
from llama_megatron.process_exit import exit_process

if __name__ == "__main__":
    exit_process(main())
