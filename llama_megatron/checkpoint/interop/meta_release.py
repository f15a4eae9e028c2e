"""Meta's original LLaMA-2 / LLaMA-3 release (``consolidated.XX.pth`` + ``params.json``) as HF-named tensors.

Model-parallel releases split tensors over several ``consolidated.XX.pth``: column-parallel ones (wq, wk, wv, w1,
w3, output) on dim 0, row-parallel ones (wo, w2) on dim 1, the embedding on dim 1 in LLaMA-2's release
(ParallelEmbedding) and dim 0 in LLaMA-3's (VocabParallelEmbedding), norms replicated. Meta's rotary embedding
pairs interleaved dimensions (2i, 2i+1), HF's pairs (i, i + d/2): q and k rows are permuted per head on the way.
Files are read weights-only and memory-mapped (:mod:`llama_megatron.checkpoint.safe_load`).
"""

from __future__ import annotations

import glob
import os
import re

import torch

from llama_megatron.checkpoint.safe_load import load_state_file
from llama_megatron.config import ModelConfig, read_json
from llama_megatron.errors import CheckpointError, ConfigError

PARAMS_FILE = "params.json"
_LLAMA3_VOCAB = 128000

# HF name suffix -> (Meta name suffix, dim the shards are concatenated on, None if replicated)
_LAYER_MAP = {
    "self_attn.q_proj.weight": ("attention.wq.weight", 0),
    "self_attn.k_proj.weight": ("attention.wk.weight", 0),
    "self_attn.v_proj.weight": ("attention.wv.weight", 0),
    "self_attn.o_proj.weight": ("attention.wo.weight", 1),
    "mlp.gate_proj.weight": ("feed_forward.w1.weight", 0),
    "mlp.down_proj.weight": ("feed_forward.w2.weight", 1),
    "mlp.up_proj.weight": ("feed_forward.w3.weight", 0),
    "input_layernorm.weight": ("attention_norm.weight", None),
    "post_attention_layernorm.weight": ("ffn_norm.weight", None),
}
_META_TO_HF = {meta: hf for hf, (meta, _) in _LAYER_MAP.items()}
_IGNORED = ("rope.freqs",)


def is_meta_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, PARAMS_FILE)) and bool(glob.glob(os.path.join(path, "consolidated.*.pth")))


def meta_intermediate_size(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """Meta's FeedForward sizing: 2/3 of 4*dim, times the multiplier, rounded up to ``multiple_of``."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def permute_rotary(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Meta (interleaved pairs) -> HF (rotate-half) row order of a q or k projection."""
    rows, dim = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, dim).transpose(1, 2).reshape(rows, dim)


class MetaCheckpoint:
    """A :class:`~llama_megatron.checkpoint.sources.TensorSource` over a Meta release directory."""

    def __init__(self, meta_dir: str, max_position_embeddings: int | None = None) -> None:
        self.meta_dir = meta_dir
        self.params = read_json(os.path.join(meta_dir, PARAMS_FILE), "Meta params.json")
        files = sorted(glob.glob(os.path.join(meta_dir, "consolidated.*.pth")))
        numbers = [int(m.group(1)) for f in files
                   if (m := re.fullmatch(r"consolidated\.(\d+)\.pth", os.path.basename(f)))]
        if not files:
            raise CheckpointError(f"no consolidated.XX.pth files in {meta_dir}")
        if sorted(numbers) != list(range(len(files))):
            missing = sorted(set(range(max(numbers) + 1)) - set(numbers))
            raise CheckpointError(f"{meta_dir}: model-parallel shard consolidated.{missing[0]:02d}.pth is missing")
        self.files = files
        self._open: dict[int, dict] = {}
        self._shapes: dict[str, list[tuple[int, ...]]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        for i in range(len(files)):
            state = self._shard(i)
            if i and set(state) != set(self._shapes):
                raise CheckpointError(f"{files[i]} holds other tensors than {files[0]}")
            for key, tensor in state.items():
                self._shapes.setdefault(key, []).append(tuple(tensor.shape))
                self._dtypes[key] = tensor.dtype
        self.release()
        self.config = self._model_config(max_position_embeddings)

    def _shard(self, i: int) -> dict:
        if i not in self._open:
            self._open[i] = load_state_file(self.files[i])
        return self._open[i]

    def _embedding_dim(self) -> int:
        shapes = self._shapes["tok_embeddings.weight"]
        return 1 if len(shapes) > 1 and shapes[0][1] != self.params["dim"] else 0

    def _meta_name(self, name: str) -> tuple[str, int | None]:
        if name == "model.embed_tokens.weight":
            return "tok_embeddings.weight", self._embedding_dim()
        if name == "model.norm.weight":
            return "norm.weight", None
        if name == "lm_head.weight":
            return "output.weight", 0
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if match and match.group(2) in _LAYER_MAP:
            suffix, dim = _LAYER_MAP[match.group(2)]
            return f"layers.{match.group(1)}.{suffix}", dim
        raise CheckpointError(f"{self.meta_dir}: no Meta tensor for {name}")

    def _full_shape(self, key: str, dim: int | None) -> tuple[int, ...]:
        shapes = self._shapes[key]
        if dim is None or len(shapes) == 1:
            return shapes[0]
        out = list(shapes[0])
        out[dim] = sum(s[dim] for s in shapes)
        return tuple(out)

    def _model_config(self, max_position_embeddings: int | None) -> ModelConfig:
        p = self.params
        for key in ("dim", "n_layers", "n_heads"):
            if key not in p:
                raise CheckpointError(f"{self.meta_dir}/{PARAMS_FILE} lacks {key!r}")
        if "tok_embeddings.weight" not in self._shapes or "layers.0.feed_forward.w1.weight" not in self._shapes:
            raise CheckpointError(f"{self.meta_dir}: consolidated files lack tok_embeddings / feed_forward weights")
        rows = self._full_shape("tok_embeddings.weight", self._embedding_dim())[0]
        vocab = p.get("vocab_size", -1)
        if vocab is None or vocab <= 0:  # LLaMA-2's params.json says -1: the tokenizer decides
            vocab = rows
        elif vocab != rows:
            raise CheckpointError(f"{PARAMS_FILE} says vocab_size {vocab}, tok_embeddings has {rows} rows")
        ffn = meta_intermediate_size(p["dim"], p.get("multiple_of", 256), p.get("ffn_dim_multiplier"))
        ffn_rows = self._full_shape("layers.0.feed_forward.w1.weight", 0)[0]
        if ffn != ffn_rows:
            raise CheckpointError(f"{PARAMS_FILE} implies intermediate size {ffn} (dim, multiple_of, "
                                  f"ffn_dim_multiplier), the w1 weights have {ffn_rows} rows")
        llama3 = vocab >= _LLAMA3_VOCAB
        rope_scaling = None
        if p.get("use_scaled_rope"):
            rope_scaling = {"rope_type": "llama3", "factor": p.get("rope_scaling_factor", 8.0), "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if max_position_embeddings is None:
            max_position_embeddings = 131072 if rope_scaling else 8192 if llama3 else 4096
        try:
            return ModelConfig(
                vocab_size=vocab, hidden_size=p["dim"], intermediate_size=ffn, num_hidden_layers=p["n_layers"],
                num_attention_heads=p["n_heads"], num_key_value_heads=p.get("n_kv_heads") or p["n_heads"],
                max_position_embeddings=max_position_embeddings, rms_norm_eps=p.get("norm_eps", 1e-5),
                rope_theta=float(p.get("rope_theta", 10000.0)), rope_scaling=rope_scaling,
                tie_word_embeddings="output.weight" not in self._shapes,
                bos_token_id=128000 if llama3 else 1, eos_token_id=128001 if llama3 else 2,
            )
        except ConfigError as exc:
            raise CheckpointError(f"{self.meta_dir}/{PARAMS_FILE}: {exc}") from None

    def names(self) -> set[str]:
        out = set()
        for key in self._shapes:
            if key.startswith(_IGNORED):
                continue
            if key == "tok_embeddings.weight":
                out.add("model.embed_tokens.weight")
            elif key == "norm.weight":
                out.add("model.norm.weight")
            elif key == "output.weight":
                out.add("lm_head.weight")
            else:
                match = re.fullmatch(r"layers\.(\d+)\.(.+)", key)
                hf = _META_TO_HF.get(match.group(2)) if match else None
                out.add(f"model.layers.{match.group(1)}.{hf}" if hf else f"meta:{key}")  # unknown: check_source says
        return out

    def info(self, name: str) -> tuple[tuple[int, ...], torch.dtype]:
        key, dim = self._meta_name(name)
        if key not in self._shapes:
            raise CheckpointError(f"{self.meta_dir}: no tensor {key}")
        return self._full_shape(key, dim), self._dtypes[key]

    def get(self, name: str) -> torch.Tensor:
        key, dim = self._meta_name(name)
        parts = [self._shard(i)[key] for i in range(len(self.files))]
        tensor = parts[0] if dim is None or len(parts) == 1 else torch.cat(parts, dim=dim)
        if name.endswith("q_proj.weight"):
            tensor = permute_rotary(tensor, self.config.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            tensor = permute_rotary(tensor, self.config.num_key_value_heads)
        return tensor

    def get_parts(self, name: str) -> list[torch.Tensor]:
        return [self.get(name)]

    def release(self) -> None:
        self._open.clear()
