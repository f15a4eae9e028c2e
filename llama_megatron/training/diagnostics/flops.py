"""Model FLOPs of a training step, from real shapes (so GQA and untied heads count right).

Per token and forward pass, each weight matmul costs 2 FLOPs per weight element:
q and o: h * (n_heads * head_dim) each, k and v: h * (n_kv_heads * head_dim) each, MLP: 3 * h * ffn, LM head: h * V;
multi-head latent attention (DeepSeek-V3) its down- and up-projections and o (``attention_matmul_weights``).
Attention scores QK^T and the weighted sum AV cost 2 * s * n_heads * head_dim each per token per layer (MLA: its
q.k width, nope + rope, and its v width); the
causal mask is *not* halved (Megatron's convention, so figures compare with published MFU); a sliding-window layer
(Mistral, Qwen) counts min(s, window) keys per query, a chunked one (Llama 4) min(s, chunk). A mixture-of-experts layer counts its router (h * experts),
the ``num_experts_per_tok`` experts each token passes through and a shared expert with its gate (Qwen2-MoE) (active
parameters, as Mixtral's "12.9B active", Qwen3's "A3B", Llama 4 Scout's "17B active" and Megatron-Core's MoE
throughput count them), not the experts a token skips; dense layers (Qwen's ``mlp_only_layers``, Llama 4's between
its MoE layers) count their own MLP.
Training = 3x forward (backward = 2x). Activation recomputation is deliberately not counted: MFU measures
model FLOPs; :func:`recomputed_flops_per_token` adds the recomputed forward passes for hardware FLOPs (HFU).
"""

from __future__ import annotations

from llama_megatron.config import ModelConfig
from llama_megatron.training.diagnostics.stage_census import recomputed_decoder_layers


def forward_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    h, L = config.hidden_size, config.num_hidden_layers
    # an MoE layer's active weights are all matmuls (router, k experts, a shared expert and its gate); a dense
    # layer's biases are not
    mlp = sum(config.mlp_parameters(i, config.num_experts_per_tok) if config.is_moe_layer(i)
              else 3 * h * config.dense_intermediate_size for i in range(L))
    attention = config.attention_matmul_weights()
    # a window or a chunk (Llama 4) bounds the keys a query's products are computed with
    spans = [window if window is not None else chunk
             for window, chunk in zip(config.layer_windows(), config.layer_chunks())]
    keys = sum(seq_len if span is None else min(seq_len, span) for span in spans)
    return (2 * (L * attention + mlp) + 2 * keys * config.num_attention_heads * config.attention_score_width()
            + 2 * h * config.vocab_size)


def training_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    return 3 * forward_flops_per_token(config, seq_len)


def recomputed_flops_per_token(config) -> int:
    """Per token, the forward FLOPs activation recomputation repeats in the backward (``activation_checkpointing``):
    the decoder layers of the recomputed spans (as PipelineModule and LlamaCausalLM form them, per pipeline stage),
    each at the mean decoder layer's forward FLOPs; 0 without recomputation. Model FLOPs (MFU) leave them out,
    hardware FLOPs (HFU) add them."""
    layers = recomputed_decoder_layers(config)
    if not layers:
        return 0
    m = config.model
    decoder = forward_flops_per_token(m, config.seq_length) - 2 * m.hidden_size * m.vocab_size
    return decoder * layers // m.num_hidden_layers
