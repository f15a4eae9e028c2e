"""Context parallelism (DeepSpeed-Ulysses): the model at CP > 1 is the same function as LlamaForCausalLM.

Each CP rank runs its contiguous shard of the sequence (input ids and labels; positions and document ids stay full
length) through the model in real gloo process groups; the shards' logits, concatenated, equal HF's, the CP ranks'
losses (the engine's loss rule: shard sum / (N / CP)) average to HF's loss, and the gradients summed over CP (what
DeepSpeed's DP x CP average does with that loss) equal HF's, tensor by tensor. Cases cover GQA with KV heads that
split evenly over CP and KV heads that must be repeated (fewer KV heads per TP rank than CP), TP with and without
SP, per-document attention across shard boundaries, dynamic RoPE (scaled by the whole sequence's longest position),
the families' sliding windows, biases and q/k norms, and the fast kernels.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from dist_utils import run_distributed
from model_utils import assert_grads_match_hf, hf_model, tiny_config

from llama_megatron.data.batch import MicroBatch
from llama_megatron.errors import ConfigError
from llama_megatron.model.build import build_model
from llama_megatron.model.kernels import REFERENCE, resolve_kernels
from llama_megatron.model.tp_slicing import hf_to_rank_state_dict
from llama_megatron.parallel.context import ParallelContext
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX
from llama_megatron.parallel.degrees import ParallelConfig, kv_head_repeats

LOGITS_ATOL = 1e-4
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
SEQ = 16


def _packed(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions and document ids of a row of three documents (5, 6 and 5 tokens): boundaries inside shards and
    on none of the shard edges of CP 2 or 4."""
    lengths = [5, 6, seq - 11]
    positions = torch.cat([torch.arange(n) for n in lengths])
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return positions.expand(2, seq).contiguous(), segments.expand(2, seq).contiguous()


def check_context_parity(overrides: dict, pctx: ParallelContext, per_document: bool = False, kernels=REFERENCE,
                         seq: int = SEQ) -> None:
    config = tiny_config(**overrides)
    parallel = ParallelConfig(tensor=pctx.tp_size, context=pctx.cp_size, sequence_parallel=pctx.sequence_parallel,
                              make_vocab_size_divisible_by=8)
    parallel.validate(config)
    padded = parallel.padded_vocab_size(config.vocab_size)
    hf = hf_model(config)
    ids = torch.randint(0, config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(7))
    labels = ids.clone()
    labels[0, 3:6] = IGNORE_INDEX
    next_labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE_INDEX)], dim=1)  # HF's shift
    if per_document:  # HF on each document alone, logits side by side
        positions, segments = _packed(seq)
        bounds = [0, *(torch.nonzero(segments[0, 1:] != segments[0, :-1]).flatten() + 1).tolist(), seq]
        ref_logits = torch.cat([hf(input_ids=ids[:, lo:hi]).logits for lo, hi in zip(bounds, bounds[1:])], dim=1)
    else:
        positions, segments = torch.arange(seq).expand(2, seq).contiguous(), None
        ref_logits = hf(input_ids=ids).logits
    ref_loss = torch.nn.functional.cross_entropy(ref_logits.flatten(0, 1), next_labels.flatten())
    ref_loss.backward()

    model = build_model(config, parallel, pctx, initialize=False, kernels=kernels)
    model.load_state_dict(hf_to_rank_state_dict(hf.state_dict(), config, pctx.tp_rank, pctx.tp_size, padded))
    mb = MicroBatch(ids, positions, next_labels, segments).context_shard(pctx.cp_rank, pctx.cp_size)
    with torch.no_grad():
        local_logits = model.full_logits(model(mb.input_ids, mb.position_ids, mb.segment_ids))
    logits = torch.cat(_gather_cp(local_logits.contiguous(), pctx), dim=1)
    assert (logits - ref_logits.detach()).abs().max().item() <= LOGITS_ATOL

    divisor = torch.tensor(int((next_labels != IGNORE_INDEX).sum()) / pctx.cp_size)  # N / (M x DP x CP)
    loss = model(mb.input_ids, mb.position_ids, mb.segment_ids, labels=(mb.labels, divisor))
    loss.backward()
    mean_loss = sum(_gather_cp(loss.detach().reshape(1), pctx)) / pctx.cp_size
    torch.testing.assert_close(mean_loss[0], ref_loss, rtol=1e-5, atol=1e-6)

    for param in model.parameters():  # DeepSpeed averages over DP x CP; the loss rule makes that the CP sum
        dist.all_reduce(param.grad, group=pctx.cp_group)
        param.grad /= pctx.cp_size
    assert_grads_match_hf(model, hf, config, pctx, **GRAD_TOL)


def _gather_cp(t: torch.Tensor, pctx: ParallelContext) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(pctx.cp_size)]
    dist.all_gather(out, t, group=pctx.cp_group)
    return out


CP4_CASES = {  # TP1 x CP4: 8 heads; KV heads 8 (even), 2 (repeated twice: 2 x 2 = 4 split over CP 4)
    "mha": (dict(), False),
    "gqa-kv2-repeated": (dict(num_key_value_heads=2), True),
}
TP2_CP2_CASES = {  # TP2 x CP2: KV heads per TP rank 2 (even) or 1 (repeated), with/without SP
    "gqa-kv4": (dict(num_key_value_heads=4), False),
    "gqa-kv2-repeated-perdoc": (dict(num_key_value_heads=2), True),
    "dynamic-rope": (dict(num_key_value_heads=2, max_position_embeddings=8,
                          rope_scaling={"rope_type": "dynamic", "factor": 2.0}), False),
    # families: a window across the shard boundary (each rank's kernel sees the whole sequence after the all-to-all)
    "mistral-window-perdoc": (dict(model_type="mistral", num_key_value_heads=2, sliding_window=5), True),
    "qwen2-windows": (dict(model_type="qwen2", num_key_value_heads=4, use_sliding_window=True, sliding_window=6,
                           max_window_layers=1), False),
    "qwen3-qk-norm": (dict(model_type="qwen3", num_key_value_heads=2, head_dim=12), True),
}


def _worker(rank: int, world_size: int) -> None:
    from llama_megatron.parallel.process_groups import init_distributed

    init_distributed()  # DeepSpeed's comm layer, which DistributedAttention's all-to-all goes through
    pctx = ParallelContext.build(context=4)
    for overrides, per_document in CP4_CASES.values():
        check_context_parity(overrides, pctx, per_document)
    for sp in (False, True):
        pctx = ParallelContext.build(tensor=2, context=2, sequence_parallel=sp)
        assert (pctx.tp_rank, pctx.cp_rank, pctx.dp_cp_size) == (rank % 2, rank // 2, 2)
        for overrides, per_document in TP2_CP2_CASES.values():
            check_context_parity(overrides, pctx, per_document)
    check_context_parity(dict(num_key_value_heads=2), pctx, per_document=True,
                         kernels=resolve_kernels("compiled", "cpu"))


@pytest.mark.launched
def test_context_parallel_model_matches_hf() -> None:
    """One 4-process launch: CP4, and CP2 x TP2 with SP off and on (reference kernels, then the fast ones)."""
    run_distributed(_worker, 4)


@pytest.mark.parametrize("kv, cp, repeats", [(4, 2, 1), (2, 4, 2), (1, 2, 2), (1, 4, 4), (3, 2, 2), (6, 4, 2)])
def test_kv_head_repeats(kv: int, cp: int, repeats: int) -> None:
    """KV heads x repeats divide by CP, and the repeats divide the query heads per KV group whenever CP divides
    the query heads (so each CP rank gets whole groups)."""
    assert kv_head_repeats(kv, cp) == repeats
    assert (kv * repeats) % cp == 0
    for group in range(1, 9):
        if (kv * group) % cp == 0:
            assert group % repeats == 0


def test_context_shard_of_a_micro_batch() -> None:
    ids = torch.arange(16).view(2, 8)
    positions, segments = torch.arange(8).expand(2, 8), torch.zeros(2, 8, dtype=torch.long)
    mb = MicroBatch(ids, positions, ids + 100, segments).context_shard(1, 2)
    assert mb.input_ids.tolist() == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert mb.labels.tolist() == [[104, 105, 106, 107], [112, 113, 114, 115]]
    assert mb.position_ids is positions and mb.segment_ids is segments  # full length


@pytest.mark.parametrize("parallel, seq, message", [
    (dict(tensor=2, context=3), 32, "context parallel degree 3 does not divide the 2 attention heads per "
                                    "tensor-parallel rank"),
    (dict(context=8), 32, "context parallel degree 8 does not divide the 4 attention heads"),
    (dict(context=2), 33, "context parallel degree 2 needs seq_length 33 divisible by 2"),
    (dict(tensor=2, context=2, sequence_parallel=True), 34,
     "sequence_parallel needs seq_length 34 divisible by context x tensor = 2 x 2"),
    (dict(context=0), 32, "parallel.context must be a positive integer"),
])
def test_bad_context_layouts(parallel, seq, message) -> None:
    config = ParallelConfig(**parallel)
    with pytest.raises(ConfigError, match=message):
        config.validate(tiny_config(num_attention_heads=4, num_key_value_heads=2))
        config.check_seq_length(seq)
