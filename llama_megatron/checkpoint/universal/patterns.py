"""Metadata DeepSpeed's universal checkpoint (``ds_to_universal``) needs to merge and re-split our parameters.

Patterns are built from the parameter layout table, one exact name per parameter, so they match what the model
really has (DeepSpeed's strict mode rejects a pattern that matches nothing). The fused QKV is a plain
column-parallel tensor for this purpose: its rows are grouped per KV group, so concatenating TP shards along
dim 0 gives a layout that splits again for any TP dividing the KV heads. A LoRA run's checkpoints hold the
adapters only (and the modules they train in full), so their patterns come from the adapter table (column-split B
matrices need none: dim 0 is DeepSpeed's default).
"""

from __future__ import annotations

import re
from typing import Any

from deepspeed.checkpoint import constants as C

from llama_megatron.config import ModelConfig
from llama_megatron.model.lora_layout import LoraConfig, adapter_layout
from llama_megatron.model.param_layout import TIED_PREFIX, ParamLayout


def universal_checkpoint_info(config: ModelConfig, lora: LoraConfig | None = None) -> dict[str, Any]:
    layout = adapter_layout(config, lora) if lora else ParamLayout(config)

    def patterns(*splits: str) -> list[str]:
        return [rf"^{re.escape(s.module_name)}$" for s in layout if s.split in splits]

    info: dict[str, Any] = {
        C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        C.TP_REPLICATED_PARAMETER_PATTERNS: patterns("replicated"),
        C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: patterns("row"),
        C.VOCABULARY_PARAMETER_PATTERNS: patterns("vocab"),
        C.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: patterns("gate_up"),
        # merged vocab tensors are cut back to the true vocab and re-padded for the loading layout
        C.ORIGINAL_VOCAB_SIZE: config.vocab_size,
    }
    if any(s.module_name.startswith(TIED_PREFIX) for s in layout):  # a tied table (a LoRA run's when it trains it)
        info[C.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = [rf"^{re.escape(TIED_PREFIX)}.*"]
    return info
