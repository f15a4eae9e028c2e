"""Online RL's rollouts on the training weights themselves (the ``grpo`` objective): every ``num_iterations``
optimizer steps, sample ``num_generations`` completions of each of the step's prompts with the engine's own module
(no export, no second copy: the same sharded weights, KV-cache decoding under TP, staged decoding over a
pipeline), score them, compute group advantages, and cut the completions into this rank's micro batches.

What a run generates does not depend on its layout: prompt ``j`` of generation ``g`` is a fixed slot of a seeded
permutation of the records (a new one each epoch), and its group is sampled from a generator seeded by (seed,
generation, slot). Each data-parallel rank decodes the groups its share of the global batch lies in (a group split
between two ranks is decoded by both, identically), scores them, and the ranks sum the rewards of the rows they
train into the whole batch's table (one all-reduce), from which every rank computes the same advantages. So a run
at TP2 x PP2 or DP2 samples what the one-process run samples, and a resumed run samples what it would have.

With ``num_iterations`` > 1 the log-probabilities of generation time (the old policy's) come from a training-layout
forward over the micro batches right after generation, as TRL computes them; with ``beta`` > 0 the reference's
come from the same forward with the LoRA adapters off, or (full fine-tuning) with the starting weights swapped in
(held_reference.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator

import numpy as np
import torch
import torch.distributed as dist

from llama_megatron.checkpoint.atomic import write_text_atomic
from llama_megatron.data.batch import MicroBatch
from llama_megatron.data.rewards import load_reward_function, score
from llama_megatron.errors import CheckpointError
from llama_megatron.model.generation import Completions, Sampling, generate_rows
from llama_megatron.model.grpo import group_advantages
from llama_megatron.model.lora import adapters_off
from llama_megatron.parallel.cross_entropy import IGNORE_INDEX
from llama_megatron.training.checkpointing import all_gather_objects, read_rank_state
from llama_megatron.training.engine.deepspeed_config import zero_stage
from llama_megatron.training.objectives import objective_of
from llama_megatron.training.run import held_reference
from llama_megatron.training.run.generate import stop_ids
from llama_megatron.training.run.held_reference import HeldReference
from llama_megatron.training.run.setup import Session

ROLLOUT_STATE = "grpo_rollout"  # the key of the generation in progress in a rank's saved state


def prompt_slot(seed: int, index: int, prompts: int) -> int:
    """The record of the ``index``-th prompt drawn: a seeded permutation of the ``prompts`` records, a new one each
    epoch."""
    epoch, position = divmod(index, prompts)
    return int(np.random.default_rng([seed, epoch]).permutation(prompts)[position])


def group_seed(seed: int, generation: int, group: int) -> int:
    """The sampling seed of one group (its completions): a function of where it is, not of who decodes it."""
    return int(np.random.SeedSequence([seed, generation, group]).generate_state(1, dtype=np.uint64)[0] >> 1)


class Rollout:
    """One GRPO run's generations; :meth:`step_batches` yields each optimizer step's micro batches of this rank."""

    def __init__(self, session: Session, log, watchdog=None) -> None:
        from llama_megatron.data.sft.chat_template import load_hf_tokenizer

        self.session, self.config, self.log = session, session.config, log
        self.watchdog = watchdog  # the stall watchdog: a generation beats it as it goes (None: nothing watches)
        self.grpo = self.config.grpo
        self.records = self.config.data.records
        self.rewards = [load_reward_function(spec) for spec in self.grpo.reward_funcs]
        self.weights = torch.tensor(self.grpo.reward_weights or [1.0] * len(self.rewards), dtype=torch.float32)
        self.tokenizer = load_hf_tokenizer(self.config.tokenizer)
        # TRL's: the tokenizer's EOS and every one the model declares (Llama 3's end of turn)
        self.stop_ids = set(self.grpo.stop_ids) if self.grpo.stop_ids else stop_ids(
            self.config, self.tokenizer, self.config.tokenizer)
        eos = self.tokenizer.eos_token_id
        self.pad_id = eos if eos is not None else 0
        self.sampling = Sampling(self.grpo.temperature, self.grpo.top_k, self.grpo.top_p)
        zero = zero_stage(session.pre.ds_config)
        self._zero3 = zero == 3
        self.reference = self._held_reference(zero) if objective_of(self.config).holds_reference_weights(
            self.config) else None
        self.metrics: dict = {}  # the last generation's, logged with the steps it serves
        self._current: tuple[int, list[MicroBatch]] | None = None  # the generation in progress and its batches
        self._steps_done = 0  # steps trained (the last batches yielded have been)

    def _held_reference(self, zero: int) -> HeldReference:
        """The starting weights, held beside the policy's (full fine-tuning with beta > 0): read back by a resumed
        run, else taken now and, where the run saves, written once into its save directory."""
        session, checkpoint = self.session, self.config.checkpoint
        module = session.engine.model
        if session.pre.checkpoint is not None and not checkpoint.finetune and session.step > 0:
            reference = held_reference.load(module, session.pre.load_dir, session.pctx, zero)
            self.log.info(f"reference weights read from {session.pre.load_dir}/{held_reference.DIRECTORY}")
            # saving elsewhere: that directory's checkpoints resume only with them beside
            if checkpoint.save and os.path.realpath(checkpoint.save) != os.path.realpath(session.pre.load_dir):
                held_reference.store(reference, checkpoint.save, session.pctx, zero)
            return reference
        reference = HeldReference(module)
        if checkpoint.save:
            held_reference.store(reference, checkpoint.save, session.pctx, zero)
        return reference

    def step_batches(self, done_steps: int, steps: int) -> Iterator[list[MicroBatch]]:
        """This rank's micro batches of steps ``done_steps + 1 .. steps``: a new generation every ``num_iterations``
        steps; a run resumed within a generation continues on the one its checkpoint saved (its completions and
        their old log-probabilities were made by weights the run has since moved)."""
        self._current = self._restored(done_steps)
        for step in range(done_steps, steps):
            generation = step // self.grpo.num_iterations
            if self._current is None or self._current[0] != generation:
                with (self.watchdog.working(step + 1, "generating completions") if self.watchdog is not None
                      else contextlib.nullcontext(lambda: None)) as progress:
                    self._current = (generation, self.generate(generation, progress))
            self._steps_done = step + 1  # once the step it is yielded for has run (a save then asks rank_state)
            yield self._current[1]

    def rank_state(self) -> dict:
        """What a save after a step within a generation keeps of it on this rank (nothing at a generation's end):
        its micro batches and metrics, read back by :meth:`step_batches` on resume."""
        if self._current is None:
            return {}
        generation, micro_batches = self._current
        if self._steps_done % self.grpo.num_iterations == 0:
            return {}
        return {ROLLOUT_STATE: {
            "generation": generation, "metrics": json.dumps(self.metrics), "layout": self._layout(),
            "input_ids": [mb.input_ids for mb in micro_batches], "labels": [mb.labels for mb in micro_batches],
            "values": {name: [mb.label_values[name] for mb in micro_batches] for name in micro_batches[0].label_values}}}

    def _restored(self, done_steps: int) -> tuple[int, list[MicroBatch]] | None:
        """The generation in progress a resumed run's checkpoint saved (None at a generation's end)."""
        pre = self.session.pre
        if done_steps % self.grpo.num_iterations == 0 or pre.checkpoint is None or self.config.checkpoint.finetune:
            return None
        rank = self.session.pctx.rank
        saved = read_rank_state(pre.load_dir, pre.checkpoint.tag, rank, ROLLOUT_STATE)
        where = f"{pre.load_dir}/{pre.checkpoint.tag} was saved within a generation"
        problem = None
        if saved is None or saved["generation"] != done_steps // self.grpo.num_iterations:
            problem = (f"{where} (step {done_steps}, grpo.num_iterations {self.grpo.num_iterations}) and holds no "
                       f"rollout of rank {rank}: resume from a generation's last step")
        elif saved.get("layout") != self._layout():  # each rank's rows of the batch, cut for that layout
            problem = (f"{where} at {saved.get('layout')}, and this run is at {self._layout()}: resume at the save's "
                       "layout, or from a generation's last step")
        problems = [p for p in all_gather_objects(problem) if p]  # every rank stops on the same line
        if problems:
            raise CheckpointError(problems[0])
        self.metrics = json.loads(saved["metrics"])
        seq = self.config.seq_length
        micro_batches = [MicroBatch(ids, torch.arange(seq).expand(ids.shape[0], seq), labels,
                                    label_values={name: values[k] for name, values in saved["values"].items()})
                         for k, (ids, labels) in enumerate(zip(saved["input_ids"], saved["labels"]))]
        self.log.info(f"continuing generation {saved['generation'] + 1} from the checkpoint's rollout")
        return saved["generation"], micro_batches

    def _layout(self) -> dict:
        """What decides a rank's rows of a generation and how they are cut into micro batches."""
        pctx = self.session.pctx
        return {"tensor": pctx.tp_size, "pipeline": pctx.pp_size, "data": pctx.dp_size, "context": pctx.cp_size,
                "expert": pctx.ep_size, "micro_batch_size": self.config.batch.micro_batch_size}

    def _groups(self) -> tuple[int, int, range]:
        """(completions per DP rank, this rank's first completion, the groups its completions lie in)."""
        pctx, batch, per_group = self.session.pctx, self.config.batch.global_batch_size, self.grpo.num_generations
        rows = batch // pctx.dp_size
        first = pctx.dp_rank * rows
        return rows, first, range(first // per_group, (first + rows - 1) // per_group + 1)

    @torch.no_grad()
    def _decode(self, generation: int, groups: range, progress) -> list[tuple[int, Completions]]:
        """Each group's record slot and completions, decoded on the engine's module in eval mode."""
        session = self.session
        module = session.engine.engine.module
        if session.pctx.pp_size > 1:
            from llama_megatron.model.staged_inference import StagedCausalLM

            model = StagedCausalLM(module, self.config.model, session.pctx,
                                   self.config.parallel.local_shapes(self.config.model))
        else:
            model = module
        module.eval()
        try:
            # decoding runs on whole sequences (SP's and CP's splits are of activations, not weights: off for it)
            with session.pctx.whole_sequences():
                out = self._decode_groups(model, generation, groups, progress)
        finally:
            module.train()
        return out

    def _decode_groups(self, model, generation: int, groups: range, progress) -> list[tuple[int, Completions]]:
        grpo, device, pctx = self.grpo, self.session.engine.device, self.session.pctx
        prompts_per_step = self.config.batch.global_batch_size // grpo.num_generations
        # data-parallel ranks decode other groups; where they share collectives inside the forward (ZeRO-3 gathers
        # the parameters over them, EP exchanges tokens among them) every rank runs as many forwards as the busiest:
        # as many groups (a rank with fewer decodes its last again, unkept) and each until all are done
        lockstep = pctx.dp_group if pctx.dp_size > 1 and (self._zero3 or pctx.ep_size > 1) else None
        count = len(groups)
        if lockstep is not None:
            most = torch.tensor([float(count)], device=device)
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=lockstep)
            count = int(most.item())
        out = []
        for k in range(count):
            group = groups[min(k, len(groups) - 1)]
            slot = prompt_slot(self.config.seed, generation * prompts_per_step + group, len(self.records))
            generator = torch.Generator(device=device).manual_seed(group_seed(self.config.seed, generation, group))
            decoded = generate_rows(model, self.records[slot].ids, grpo.num_generations, grpo.max_completion_length,
                                    self.stop_ids, self.sampling, generator=generator, lockstep=lockstep)
            if k < len(groups):
                out.append((slot, decoded))
            progress()
        return out

    def generate(self, generation: int, progress=lambda: None) -> list[MicroBatch]:
        """Decode, score and cut generation ``generation`` into this rank's micro batches; ``progress`` is called
        after each group decoded, the scoring and each forward pass after it (the stall watchdog's beat)."""
        session, grpo, pctx = self.session, self.grpo, self.session.pctx
        start = time.perf_counter()
        rows, first, groups = self._groups()
        decoded = self._decode(generation, groups, progress)
        decode_s = time.perf_counter() - start
        per_group = grpo.num_generations
        # every generated completion, in batch order from the first group's first
        slots = [slot for slot, _ in decoded for _ in range(per_group)]
        tokens = [row for _, c in decoded for row in c.tokens]
        logprobs = [row for _, c in decoded for row in c.logprobs]
        truncated = [t for _, c in decoded for t in c.truncated]
        texts = self._texts(tokens)
        rewards = self._score(slots, tokens, texts)
        progress()
        # this rank's rows of the whole batch's table; the ranks' rows are disjoint, so a sum is the table
        batch = self.config.batch.global_batch_size
        offset = first - groups.start * per_group
        table = torch.zeros(batch, len(self.rewards) + 2, dtype=torch.float64)
        mine = slice(first, first + rows)
        table[mine, :-2] = rewards[offset:offset + rows].double()
        table[mine, -2] = torch.tensor([float(len(t)) for t in tokens[offset:offset + rows]], dtype=torch.float64)
        table[mine, -1] = torch.tensor([float(t) for t in truncated[offset:offset + rows]], dtype=torch.float64)
        if pctx.dp_size > 1:  # on the engine's device: NCCL reduces no host tensor
            on_device = table.to(session.engine.device)
            dist.all_reduce(on_device, group=pctx.dp_group)
            table = on_device.cpu()
        per_function = table[:, :-2].float()
        advantages = group_advantages(per_function, self.weights, per_group, grpo.scale_rewards)
        local = slice(offset, offset + rows)
        micro_batches = self._micro_batches(slots[local], tokens[local], logprobs[local], truncated[local],
                                            advantages.advantages[first:first + rows])
        self._log_probs(micro_batches, progress)
        generated = sum(len(t) for t in tokens)  # this rank's decoding: its groups' tokens
        self.metrics = self._metrics(per_function, advantages, table[:, -2], table[:, -1], decode_s, generated)
        if grpo.log_completions:
            self._write_completions(generation, slots[local], tokens[local], texts[local], per_function[first:first + rows],
                                    advantages.advantages[first:first + rows])
        self.metrics["generation_s"] = time.perf_counter() - start
        return micro_batches

    def _texts(self, tokens: list[list[int]]) -> list[str]:
        """TRL's decoding: every completion token, the special ones (an EOS) skipped."""
        return self.tokenizer.batch_decode(tokens, skip_special_tokens=True)

    def _score(self, slots: list[int], tokens: list[list[int]], texts: list[str]) -> torch.Tensor:
        """Every reward function's reward of every completion (TRL's call: prompts, completions as text, or as one
        assistant message for a conversational prompt, completion ids, the records' other columns)."""
        records = [self.records[slot] for slot in slots]
        completions = [[{"role": "assistant", "content": text}] if isinstance(r.prompt, list) else text
                       for r, text in zip(records, texts)]
        keys = sorted({key for r in records for key in r.columns})
        columns = {key: [r.columns.get(key) for r in records] for key in keys}
        return score(self.rewards, [r.prompt for r in records], completions, tokens, columns)

    def _micro_batches(self, slots: list[int], tokens: list[list[int]], logprobs: list[list[float]],
                       truncated: list[bool], advantages: torch.Tensor) -> list[MicroBatch]:
        """Rows of prompt + completion padded to seq_length, the completion's tokens as the labels (none of a
        truncated completion's under ``mask_truncated_completions``)."""
        seq, micro = self.config.seq_length, self.config.batch.micro_batch_size
        count = len(tokens)
        ids = torch.full((count, seq + 1), self.pad_id, dtype=torch.long)
        labels = torch.full((count, seq), IGNORE_INDEX, dtype=torch.long)
        sampler = torch.zeros(count, seq)
        for i, (slot, row, row_logprobs) in enumerate(zip(slots, tokens, logprobs)):
            prompt = self.records[slot].ids
            whole = prompt + row
            ids[i, :len(whole)] = torch.tensor(whole[:seq + 1])
            span = slice(len(prompt) - 1, len(prompt) - 1 + len(row))  # the positions whose next token is a completion's
            if not (self.grpo.mask_truncated_completions and truncated[i]):
                labels[i, span] = torch.tensor(row)
            sampler[i, span] = torch.tensor(row_logprobs)
        positions = torch.arange(seq).expand(count, seq)
        values = {"advantages": advantages.float()[:, None].expand(count, seq).contiguous(),
                  "old_logps": torch.zeros(count, seq), "ref_logps": torch.zeros(count, seq),
                  "sampler_logps": sampler}
        pctx = self.session.pctx
        return [MicroBatch(ids[k:k + micro, :-1].contiguous(), positions[k:k + micro], labels[k:k + micro],
                           label_values={name: v[k:k + micro] for name, v in values.items()}
                           ).context_shard(pctx.cp_rank, pctx.cp_size)  # a CP rank trains its shard of each row
                for k in range(0, count, micro)]

    def _log_probs(self, micro_batches: list[MicroBatch], progress) -> None:
        """The old policy's (``num_iterations`` > 1) and the reference's (``beta`` > 0) log-probabilities of every
        label, from a training-layout forward now (the reference's: LoRA adapters off)."""
        passes = []
        if self.grpo.num_iterations > 1:
            passes.append(("old_logps", False))
        if self.grpo.beta != 0.0:
            passes.append(("ref_logps", True))
        engine = self.session.engine
        objective = engine.model.loss_fn.objective
        for name, reference in passes:
            objective.captured = []
            try:
                # the reference: the starting weights swapped in, or a LoRA run's base (adapters off)
                with (contextlib.nullcontext() if not reference else self.reference.swapped_in()
                      if self.reference is not None else adapters_off(engine.model)):
                    engine.eval_loss(micro_batches, progress)
                captured = objective.captured
            finally:
                objective.captured = None
            for mb, logps in zip(micro_batches, captured):  # on the ranks holding the loss; the others never read them
                mb.label_values[name] = logps.float().cpu()

    def _metrics(self, per_function: torch.Tensor, advantages, lengths: torch.Tensor, truncated: torch.Tensor,
                 decode_s: float, generated: int) -> dict:
        """TRL's rollout metrics of the whole batch (every rank the same), and this rank's decoding rate."""
        out: dict = {}
        for j, reward in enumerate(self.rewards):
            column = per_function[:, j]
            out[f"rewards/{reward.name}/mean"] = float(torch.nanmean(column))
            out[f"rewards/{reward.name}/std"] = float(_nan_std(column))
        groups = advantages.rewards.view(-1, self.grpo.num_generations)
        # a group whose rewards are all equal teaches nothing (its advantages are 0)
        out["reward"] = float(torch.nanmean(advantages.rewards))
        out["reward_std"] = float(_nan_std(advantages.rewards))  # over the whole batch (TRL's reward_std)
        stds = advantages.std.view(groups.shape)[:, 0]
        out["frac_reward_zero_std"] = float(torch.isclose(stds, torch.zeros_like(stds)).double().mean())  # TRL's
        out["advantages/std"] = float(advantages.advantages.std())
        out["completions/mean_length"] = float(lengths.mean())
        out["completions/max_length"] = float(lengths.max())
        out["completions/clipped_ratio"] = float(truncated.mean())
        out["rollout_tokens_per_s"] = generated / max(decode_s, 1e-9)
        return out

    def _write_completions(self, generation: int, slots: list[int], tokens: list[list[int]], texts: list[str],
                           rewards: torch.Tensor, advantages: torch.Tensor) -> None:
        """``completions/generation_<g>.jsonl`` in the run's output_dir: this generation's completions with their
        token ids, rewards and advantages, every rank's, written by global rank 0."""
        pctx = self.session.pctx
        rows = [{"record": slot, "prompt": self.records[slot].prompt, "completion": text, "completion_ids": row,
                 "rewards": {r.name: (None if v != v else float(v)) for r, v in zip(self.rewards, reward.tolist())},
                 "advantage": float(adv)}
                for slot, text, row, reward, adv in zip(slots, texts, tokens, rewards, advantages)]
        if pctx.dp_size > 1:
            gathered: list = [None] * pctx.dp_size
            dist.all_gather_object(gathered, rows, group=pctx.dp_group)
            rows = [row for part in gathered for row in part]
        if pctx.rank != 0:
            return
        directory = os.path.join(self.config.output_dir, "completions")
        os.makedirs(directory, exist_ok=True)
        write_text_atomic(os.path.join(directory, f"generation_{generation + 1:06d}.jsonl"),
                          "".join(json.dumps(row) + "\n" for row in rows))


def _nan_std(values: torch.Tensor) -> torch.Tensor:
    kept = values[~torch.isnan(values)]
    return kept.std() if kept.numel() > 1 else torch.zeros(())
