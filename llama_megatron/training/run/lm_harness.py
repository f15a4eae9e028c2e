"""lm-evaluation-harness on a checkpoint where it lives: :class:`LlamaMegatronLM`, an lm-eval model backend
(registered as ``llama_megatron``), and :func:`evaluate_tasks`, what ``llama-megatron evaluate --tasks`` runs.

The backend *is* lm-eval's HF backend (``lm_eval.models.huggingface.HFLM``) over our sharded model: tokenisation
(BOS, the context/continuation split), request ordering and batching, the one-token-continuation logits cache, the
rolling windows of ``loglikelihood_rolling`` and the post-processing of ``generate_until`` are lm-eval's own code,
unchanged. Only the two calls into a model are ours:

- ``_model_call``: the full-vocabulary logits of a right-padded batch, from our model at the checkpoint's TP (the
  TP shards gathered; causal attention, so the padding after a row changes none of its logits);
- ``_model_generate``: our KV-cache decoding (:func:`~llama_megatron.model.generation.generate`) row by row, from
  each row's tokens without its left padding, stopping at EOS or at the first token after which a stop sequence
  appears in the decoded text (lm-eval cuts the text at the sequence afterwards, as it does HF's).

So the results are those of ``lm_eval --model hf`` on the exported model, within the two models' arithmetic
(``tests/test_training_lm_eval.py``). Layouts: every process is one rank of the checkpoint's TP over any number of
pipeline stages and expert ranks (as ``generate`` reads it), or of the run being trained (:func:`task_metrics`);
lm-eval sees one process: the data-parallel replicas share the requests (:meth:`LlamaMegatronLM._shared`), the ranks
of a replica run theirs together, and global rank 0 writes the results.
"""

from __future__ import annotations

import json
import os
from typing import Any

from llama_megatron.training.run.lm_tasks import go_offline, needs_lm_eval_tasks, task_configs, task_manager

go_offline()  # before lm_eval imports datasets

import torch  # noqa: E402
import transformers  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from llama_megatron.errors import ConfigError  # noqa: E402
from llama_megatron.lm_eval_registration import MODEL_NAME  # noqa: E402
from llama_megatron.model.generation import Sampling, generate  # noqa: E402
from llama_megatron.parallel.placement import adopt_launcher_env  # noqa: E402
from llama_megatron.training.run.generate import GenerationRequest, InferenceModel, open_checkpoint  # noqa: E402


class _ShardedCausalLM(transformers.PreTrainedModel):
    """Our model as the ``PreTrainedModel`` HFLM is given: its HF config (the checkpoint's, as exported) and a
    forward that returns the full logits. HFLM reads the config, the device and the dtype from it."""

    config_class = transformers.PretrainedConfig
    base_model_prefix = "inner"

    def __init__(self, hf_config: transformers.PretrainedConfig, inner: torch.nn.Module) -> None:
        super().__init__(hf_config)
        self.inner = inner

    def forward(self, input_ids: torch.Tensor, **_: Any) -> CausalLMOutputWithPast:
        with torch.no_grad():
            return CausalLMOutputWithPast(logits=self.inner.full_logits(self.inner(input_ids)).float())


@register_model(MODEL_NAME)  # the name the installed start-up line registers too
class LlamaMegatronLM(HFLM):
    """``lm_eval.simple_evaluate(model="llama_megatron", model_args="checkpoint=DIR")`` or an instance: a checkpoint
    (converted, trained or LoRA) loaded through the setup path ``generate`` uses; the rest of the arguments are
    HFLM's (``batch_size``, ``max_length``, ``add_bos_token``, ``prefix_token_id``, ...), and so is what they do: a
    request without a context (an empty one, a rolling log-likelihood's first window) is prefixed with
    ``prefix_token_id``, else the tokenizer's BOS, else its EOS (a Qwen2 tokenizer has no BOS)."""

    def __init__(self, checkpoint: str | None = None, tag: str | None = None, tokenizer: str | None = None,
                 kernels: str = "auto", dtype: str | None = None, pipeline: int = 1, expert: int = 1,
                 loaded: InferenceModel | None = None, **kwargs: Any) -> None:
        if loaded is None:
            if checkpoint is None:
                raise ConfigError("the llama_megatron lm-eval model needs checkpoint=DIR")
            adopt_launcher_env()  # one process, or a rank of the deepspeed launcher / torchrun
            loaded = open_checkpoint(GenerationRequest(checkpoint=checkpoint, prompts=[], tag=tag,
                                                       tokenizer=tokenizer, kernels=kernels, dtype=dtype,
                                                       pipeline=int(pipeline), expert=int(expert)))
        self.loaded = loaded
        model = loaded.config.model.to_hf_dict()
        hf_config = transformers.AutoConfig.for_model(**model)
        kwargs.setdefault("max_length", loaded.config.model.max_position_embeddings)
        super().__init__(pretrained=_ShardedCausalLM(hf_config, loaded.model), tokenizer=loaded.tokenizer_dir,
                         **kwargs)
        # the layout's data-parallel replicas share the model's work: the ranks of one copy of the model (its TP, PP
        # and EP ranks) run the same requests; each replica every N-th request of lm-eval's list, the answers
        # gathered. The replicas are the data-parallel ranks, EP's taken together (an EP group needs all of its
        # ranks in every forward); not under CP (its ranks would compute alike: FP8's amax is reduced over them).
        # lm-eval itself sees one process, so its documents, few-shot draws and results are those of one process
        # (its own data parallelism gives each rank its documents, which changes the few-shot examples drawn)
        pctx = loaded.pctx
        split = pctx.cp_size == 1 and pctx.dp_size > pctx.ep_size
        self._replica = pctx.dp_rank // pctx.ep_size if split else 0
        self._replica_count = pctx.dp_size // pctx.ep_size if split else 1
        self._replica_group = pctx.edp_group if split else None  # one rank of each replica, this rank's place

    def _shared(self, method: str, requests: list, disable_tqdm: bool) -> list:
        """HFLM's ``method`` on this replica's share of ``requests``, every replica's answers in request order."""
        run = getattr(super(), method)
        if self._replica_count == 1:
            return run(requests, disable_tqdm=disable_tqdm)
        share = requests[self._replica::self._replica_count]
        mine = run(share, disable_tqdm=disable_tqdm) if share else []  # fewer requests than replicas
        shares: list = [None] * self._replica_count
        torch.distributed.all_gather_object(shares, mine, group=self._replica_group)
        answers: list = [None] * len(requests)
        for replica, answered in enumerate(shares):
            answers[replica::self._replica_count] = answered
        return answers

    def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list:
        return self._shared("loglikelihood", requests, disable_tqdm)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list:
        return self._shared("loglikelihood_rolling", requests, disable_tqdm)

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list:
        return self._shared("generate_until", requests, disable_tqdm)

    def _model_generate(self, context: torch.Tensor, max_length: int, stop: list[str],
                        **generation_kwargs: Any) -> torch.Tensor:
        """[rows, max_length at most] tokens: each row's context as given (left padding kept) and its new tokens,
        rows padded at the end with the pad token (which lm-eval's decoding skips), as HF's ``generate`` returns."""
        mask = generation_kwargs.pop("attention_mask", None)
        temperature = float(generation_kwargs.pop("temperature", 0.0) or 0.0)
        sampling = Sampling(temperature if generation_kwargs.pop("do_sample", False) else 0.0,
                            int(generation_kwargs.pop("top_k", 0) or 0),
                            float(generation_kwargs.pop("top_p", 1.0) or 1.0))

        def stop_when(new: list[int]) -> bool:
            text = self.tokenizer.decode(new, skip_special_tokens=False)
            return any(sequence in text for sequence in stop)

        stop_ids = {self.tokenizer.eos_token_id}
        rows = []
        for row in range(context.shape[0]):
            ids = context[row] if mask is None else context[row][mask[row].bool()]
            new = generate(self.loaded.model, ids.tolist(), max_length - context.shape[1], stop_ids, sampling,
                           stop_when=stop_when)
            rows.append(context[row].tolist() + new)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eot_token_id
        width = max(len(r) for r in rows)
        return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)


def evaluate_tasks(lm: LlamaMegatronLM, tasks: list[str | dict], limit: int | None, num_fewshot: int | None,
                   seed: int = 1234, log_samples: bool = False) -> dict | None:
    """lm-eval's ``simple_evaluate`` of ``tasks`` on ``lm``: its results dict (``results``, ``configs``, ...) on each
    node's local rank 0, None on the other ranks (lm-eval returns them there only)."""
    from lm_eval import simple_evaluate

    configs = task_configs(tasks)
    return simple_evaluate(model=lm, tasks=configs, limit=limit, num_fewshot=num_fewshot,
                           random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                           log_samples=log_samples, task_manager=task_manager(needs_lm_eval_tasks(configs)))


def results_table(results: dict) -> str:
    """lm-eval's own table of the results."""
    from lm_eval.utils import make_table

    return make_table(results)


def write_results(results: dict, path: str) -> None:
    """The results JSON, written atomically (lm-eval's dict without the per-sample records)."""
    from llama_megatron.checkpoint.atomic import write_text_atomic

    kept = {k: v for k, v in results.items() if k != "samples"}
    write_text_atomic(path, json.dumps(kept, indent=2, default=str) + "\n")


def task_metrics(config, pctx, model: torch.nn.Module, step: int, batch_size: int = 4) -> dict[str, float]:
    """``config.eval.tasks`` on ``model`` (the training engine's module: no copy, no export) under the run's layout,
    the requests shared among its data-parallel replicas (:class:`LlamaMegatronLM`): a pipeline-parallel module runs stage after stage
    (:class:`~llama_megatron.model.staged_inference.StagedCausalLM`), and every rank takes whole sequences
    (``pctx.whole_sequences``: SP and CP off, which split no weight). ``{"tasks/<task>/<metric>": value}`` of
    lm-eval's numeric metrics (standard errors left out), empty where lm-eval returns nothing (a node's ranks but
    its first); global rank 0 writes lm-eval's results to ``output_dir/tasks/step<N>.json`` (and every document's
    record to ``step<N>.samples.jsonl`` with ``eval.tasks_log_samples``). The model is put in eval mode for it and
    back in train mode after."""
    from llama_megatron.data.sft.chat_template import load_hf_tokenizer
    from llama_megatron.model.staged_inference import StagedCausalLM

    evaluation = config.eval
    inner = model if pctx.pp_size == 1 else StagedCausalLM(model, config.model, pctx,
                                                           config.parallel.local_shapes(config.model))
    loaded = InferenceModel(config, pctx, inner, config.tokenizer, load_hf_tokenizer(config.tokenizer))
    lm = LlamaMegatronLM(loaded=loaded, batch_size=batch_size)  # its replicas read off the run's layout, CP included
    model.eval()
    try:
        with pctx.whole_sequences():
            results = evaluate_tasks(lm, list(evaluation.tasks), evaluation.tasks_limit, evaluation.tasks_fewshot,
                                     seed=config.seed, log_samples=evaluation.tasks_log_samples)
    finally:
        model.train()
    out: dict[str, float] = {}
    if results is None:  # lm-eval returns them on each node's local rank 0 only; rank 0 logs them
        return out
    if pctx.rank == 0:
        directory = os.path.join(config.output_dir, "tasks")
        os.makedirs(directory, exist_ok=True)
        write_results(results, os.path.join(directory, f"step{step}.json"))
        if evaluation.tasks_log_samples:
            write_samples(results, os.path.join(directory, f"step{step}.samples.jsonl"))
    for task, metrics in results["results"].items():
        for name, value in metrics.items():  # "acc,none": a metric under its filter; alias, sample_len: not metrics
            metric = name.split(",")[0]
            if ("," in name and isinstance(value, (int, float)) and not isinstance(value, bool)
                    and not metric.endswith("_stderr")):
                out[f"tasks/{task}/{metric}"] = float(value)
    return out


def write_samples(results: dict, path: str) -> None:
    """Every document's record (lm-eval's ``samples``: its requests' arguments, responses, filtered responses and
    metrics), one JSON line each with its task, written atomically."""
    from llama_megatron.checkpoint.atomic import write_text_atomic

    lines = [json.dumps({"task": task, **sample}, default=str) for task, samples in results["samples"].items()
             for sample in samples]
    write_text_atomic(path, "".join(line + "\n" for line in lines))
