"""What the lm-eval tests share: the shipped tokenizer, a Qwen2 tokenizer (no BOS) made here, lm-eval's HF backend on
an exported model (optionally with a PEFT adapter), samples files read back, and the request-by-request comparison
with the HF backend."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from launch_utils import ROOT

TOKENIZER = os.path.join(ROOT, "data", "tokenizer")


def add_tokenizer(hf_dir: str) -> None:
    """The shipped tokenizer beside exported weights, as a user's HF directory has it."""
    for name in os.listdir(TOKENIZER):
        if not os.path.exists(os.path.join(hf_dir, name)):
            shutil.copy(os.path.join(TOKENIZER, name), os.path.join(hf_dir, name))


def qwen2_tokenizer(directory: str) -> None:
    """A Qwen2 tokenizer in ``directory``: transformers' ``Qwen2Tokenizer`` (byte-level BPE behind Qwen2's
    pre-tokenizer, ``"bos_token": null``, EOS and pad ``<|endoftext|>``) over a vocabulary of 1000 learnt from a
    sixth of the shipped corpus (0.1 s): no Qwen2 tokenizer is shipped or installed, and nothing downloads."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    with open(os.path.join(ROOT, "data", "corpus", "shakespeare.jsonl"), encoding="utf-8") as fh:
        texts = [json.loads(line)["text"] for line in fh][::6]
    rust = Tokenizer(models.BPE())  # the pipeline Qwen2Tokenizer builds around its vocabulary and merges
    rust.normalizer = normalizers.NFC()
    rust.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), "isolated"),
                                                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    rust.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000, show_progress=False,
                                                        special_tokens=["<|endoftext|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    learnt = json.loads(rust.to_str())["model"]
    Qwen2Tokenizer(vocab=learnt["vocab"], merges=[tuple(m) for m in learnt["merges"]]).save_pretrained(directory)


def hf_results(hf_dir: str, tasks: list[str], limit: int, fewshot: int | None, seed: int = 1234,
               peft: str | None = None, tokenizer: str | None = None, **hflm_args) -> dict:
    """lm-eval's HF backend (fp32, CPU) on ``hf_dir`` (with the PEFT adapter directory ``peft``, the tokenizer of
    the directory ``tokenizer``, HFLM's ``hflm_args`` such as ``prefix_token_id``): its results with every sample,
    drawn as ours are (the same few-shot seed)."""
    from lm_eval.models.huggingface import HFLM

    from llama_megatron.training.run.lm_harness import evaluate_tasks

    if peft is None:
        model = HFLM(pretrained=hf_dir, device="cpu", dtype="float32", batch_size=1, tokenizer=tokenizer,
                     **hflm_args)
    else:
        # the PeftModel made here and handed over: HFLM's own `peft=` resizes the embeddings to the tokenizer's
        # length when the model's vocab is larger (a padded vocab, as here), which changes every log-probability
        import torch
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
        model = HFLM(pretrained=PeftModel.from_pretrained(base, peft).eval(), tokenizer=tokenizer or hf_dir,
                     batch_size=1, **hflm_args)
    return evaluate_tasks(model, tasks, limit, fewshot, seed=seed, log_samples=True)


def read_samples(path) -> dict[str, list[dict]]:
    """A samples file (``--log-samples``, ``eval.tasks_log_samples``) by task."""
    samples: dict[str, list[dict]] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            record = json.loads(line)
            samples.setdefault(record["task"], []).append(record)
    return samples


def assert_same_as_hf(samples: dict[str, list[dict]], results: dict, reference: dict) -> None:
    """Request by request: log-likelihoods within 1e-4 with the same is_greedy, generations identical; then every
    metric of every task equal (the reference's tasks, each with as many documents)."""
    for task in reference["results"]:
        ours = sorted(samples[task], key=lambda s: s["doc_id"])
        theirs = sorted(reference["samples"][task], key=lambda s: s["doc_id"])
        assert [s["doc_id"] for s in ours] == [s["doc_id"] for s in theirs] and ours
        for mine, hf in zip(ours, theirs):
            for got, want in zip(mine["resps"], hf["resps"], strict=True):
                if task == "shakespeare_continue":
                    assert got == want, (task, mine["doc_id"], got, want)
                elif task == "shakespeare_passages":  # a sum over a whole passage's tokens
                    assert got[0] == pytest.approx(want[0], abs=1e-3), (task, got, want)
                else:
                    (logprob, greedy), (ref_logprob, ref_greedy) = got[0], want[0]
                    assert abs(logprob - ref_logprob) < 1e-4 and greedy == ref_greedy, (task, got, want)
        for metric, value in reference["results"][task].items():
            got = results["results"][task][metric]
            if isinstance(value, (int, float)):
                assert got == pytest.approx(value, rel=1e-6, abs=1e-9), (task, metric, got, value)
            else:  # the alias, "N/A" standard errors
                assert got == value, (task, metric, got, value)
