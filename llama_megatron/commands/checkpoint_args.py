"""Arguments and output shared by the ``convert``, ``export`` and ``reshard`` verbs."""

from __future__ import annotations

import argparse
import re

from llama_megatron.checkpoint.interop.convert import Result
from llama_megatron.checkpoint.interop.hf_writer import DTYPE_NAMES
from llama_megatron.errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ConfigError(f"cannot parse size {text!r} (examples: 5GB, 500MB, 2GiB)")
    size = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if size <= 0:
        raise ConfigError(f"size must be positive, got {text!r}")
    return size


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, required=True, metavar="N", help="tensor-parallel degree of the output")
    parser.add_argument("--pp", type=int, default=1, metavar="M",
                        help="pipeline-parallel degree of the output (default 1)")
    parser.add_argument("--make-vocab-size-divisible-by", type=int, default=128, dest="divisible_by", metavar="N",
                        help="vocab padding multiple per TP rank; must match the run's parallel section (128)")


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, metavar="DIR",
                        help="checkpoint directory (training save dir or converted)")
    parser.add_argument("--output", required=True, metavar="DIR", help="HF model directory to create")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default=None,
                        help="weights dtype (default: the checkpoint's; fp32 of a bf16 run uses the fp32 masters)")
    parser.add_argument("--tag", default=None, help="checkpoint tag, e.g. global_step1000 (default: latest)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="directory to copy tokenizer files (and generation_config.json) from "
                             "(default: INPUT/hf_config of a converted checkpoint)")
    parser.add_argument("--max-shard-size", default="5GB", help="safetensors shard size (default 5GB)")
    parser.add_argument("--into", default=None, metavar="ORIGINAL_DIR",
                        help="write OUTPUT as a copy of this released HF directory with the trained weights put in "
                             "its own files (a multimodal Llama 4: the text model replaced, the vision tower's "
                             "bytes unchanged)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")


def report(what: str, result: Result) -> int:
    note = f" ({result.note})" if result.note else ""
    print(f"{what}: wrote {result.output} [{str(result.dtype).removeprefix('torch.')}] in {result.seconds:.1f} s{note}",
          flush=True)
    return 0
