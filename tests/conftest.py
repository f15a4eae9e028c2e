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
