"""Metadata DeepSpeed's universal checkpoint (``ds_to_universal``) needs to merge and re-split our parameters.

Patterns are built from the parameters the model really has (DeepSpeed's strict mode rejects a pattern that
matches nothing). The fused QKV is a plain column-parallel tensor for this purpose: its rows are grouped per KV
group, so concatenating TP shards along dim 0 gives a layout that splits again for any TP dividing the KV heads.
"""

from __future__ import annotations

from typing import Any

from deepspeed.checkpoint import constants as C

from llama_megatron.checkpoint.hf_mapping import canonical_names
from llama_megatron.config import ModelConfig


def universal_checkpoint_info(config: ModelConfig) -> dict[str, Any]:
    names = canonical_names(config)

    def present(suffixes: tuple[str, ...]) -> list[str]:
        found = sorted({s for s in suffixes if any(n.endswith(s) for n in names)})
        return [rf".*{s.replace('.', chr(92) + '.')}$" for s in found]

    info: dict[str, Any] = {
        C.UNIVERSAL_CHECKPOINT_VERSION_KEY: C.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        C.TP_REPLICATED_PARAMETER_PATTERNS: present(
            ("input_layernorm.weight", "post_attention_layernorm.weight", "o_proj.bias",
             "down_proj.bias")
        ) + [r"^\d+\.norm\.weight$"],
        C.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: present(("o_proj.weight", "down_proj.weight")),
        C.VOCABULARY_PARAMETER_PATTERNS: [r".*word_embeddings\.weight$"]
        + ([] if config.tie_word_embeddings else [r".*lm_head\.weight$"]),
        C.PARAMETER_WITH_2_SUB_PARAMS_CAT_DIM_0: present(("gate_up_proj.weight", "gate_up_proj.bias")),
        # merged vocab tensors are cut back to the true vocab and re-padded for the loading layout
        C.ORIGINAL_VOCAB_SIZE: config.vocab_size,
    }
    if config.tie_word_embeddings:
        info[C.PIPELINE_REPLICATED_PARAMETER_PATTERNS] = [r"^tied_modules\.embed\..*"]
    return info
