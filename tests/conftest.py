import os
import sys

# Multi-process tests on a 2-core machine: one thread per process, or they oversubscribe and crawl.
os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def shakespeare_prefix(tmp_path_factory) -> str:
    """The shipped corpus tokenised by `llama-megatron preprocess` (with EOD), once per test session."""
    from llama_megatron.cli import main as cli_main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    prefix = str(tmp_path_factory.mktemp("shakespeare") / "shakespeare")
    assert cli_main(["preprocess", "--input", os.path.join(root, "data/corpus/shakespeare.jsonl"), "--tokenizer",
                     os.path.join(root, "data/tokenizer"), "--output-prefix", prefix, "--append-eod",
                     "--quiet"]) == 0
    return prefix + "_text_document"


@pytest.fixture(scope="session")
def short_documents_prefix(tmp_path_factory) -> str:
    """Every line of the corpus as its own document (with EOD): most samples pack several documents, so
    per-document attention differs from causal attention in almost every sample."""
    import json

    from llama_megatron.cli import main as cli_main

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path_factory.mktemp("short-docs")
    text = out / "lines.txt"
    with open(os.path.join(root, "data/corpus/shakespeare.jsonl"), encoding="utf-8") as src:
        lines = [line for record in src for line in json.loads(record)["text"].splitlines() if line.strip()]
    text.write_text("\n".join(lines[:20000]) + "\n", encoding="utf-8")
    assert cli_main(["preprocess", "--input", str(text), "--tokenizer", os.path.join(root, "data/tokenizer"),
                     "--output-prefix", str(out / "lines"), "--append-eod", "--quiet"]) == 0
    return str(out / "lines_text_document")


# The slowest test files on a 2-core CPU (seconds, measured), started first so that the two xdist workers
# (scripts/test.sh) finish together instead of one running a long file alone at the end. A file not listed runs
# after these, in collection order; a wrong figure costs time, never a result.
FILE_SECONDS = {
    "test_training_e2e.py": 390, "test_kernels.py": 116, "test_estimate.py": 103, "test_faults.py": 95,
    "test_lora.py": 84, "test_sft_e2e.py": 82, "test_benchmark_scripts.py": 110, "test_finetune_recipe.py": 76,
    "test_convert_deepspeed.py": 63, "test_context_parallel.py": 60, "test_checkpoint_safety.py": 51,
    "test_multinode.py": 150, "test_generate.py": 38, "test_doctor.py": 30, "test_zero3_init.py": 60, "test_universal_conversion.py": 70, "test_pipeline_schedules.py": 130, "test_weight_grad_split.py": 40, "test_init_invariance.py": 34, "test_model_parity.py": 28, "test_model_families.py": 100,
    "test_moe.py": 25,
}


def pytest_collection_modifyitems(config, items) -> None:
    items.sort(key=lambda item: -FILE_SECONDS.get(item.path.name, 0))  # stable: a file's own order is kept
