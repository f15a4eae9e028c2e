"""DeepSpeed's ``ds_to_universal`` for our checkpoints, every expert of an expert-parallel run included.

Run in place of ``python -m deepspeed.checkpoint.ds_to_universal`` (same arguments; checkpoint/universal/conversion.py
starts it). ``ds_to_universal`` merges each parameter's ZeRO fragments under the names and shapes the ``mp_rank``
files list, and data-parallel rank 0 writes those with its own parameters only: at EP > 1 that is its own EP rank's
experts, so the other ranks' experts would be left out (and the universal-checkpoint patterns, which name every
expert, fail its strict check). Every expert of a layer has the same shape on every rank (experts split evenly over
TP, names carrying the global expert id), so each file's list is completed from the experts it holds; the rest is
``ds_to_universal``'s own work: an expert's fragments come from the ranks of its expert-data-parallel group, which
lie on the data axis in partition order (parallel/context.py), so its merge in data-parallel order is the expert's
whole fp32 master, Adam moments and step. Loading takes each rank's experts by name and cuts them for its own
expert-data-parallel partition (DeepSpeed's universal loader), at any EP and DP x CP.
"""

from __future__ import annotations

import json
import os
import re
import sys

from llama_megatron.checkpoint.directory import META_FILE
from llama_megatron.process_exit import exit_process

EXPERT_NAME = re.compile(r"^(?P<head>.*\.experts\.)(?P<expert>\d+)(?P<tail>\..+)$")


def complete_expert_shapes(shapes: dict, num_experts: int) -> dict:
    """``shapes`` (parameter name -> shape, one ``mp_rank`` file's) with every expert of each layer it holds experts
    of, shaped as the ones it holds."""
    out = dict(shapes)
    for name, shape in shapes.items():
        match = EXPERT_NAME.match(name)
        if match:
            for expert in range(num_experts):
                out.setdefault(f"{match['head']}{expert}{match['tail']}", shape)
    return out


def _num_experts(input_folder: str) -> int:
    """The experts of each MoE layer when the checkpoint's run split them over EP ranks; 0 otherwise."""
    path = os.path.join(input_folder, META_FILE)
    if not os.path.isfile(path):
        return 0
    with open(path, encoding="utf-8") as fh:
        meta = json.load(fh)
    return int(meta["model"].get("num_local_experts") or 0) if meta.get("expert", 1) > 1 else 0


def main() -> None:
    from deepspeed.checkpoint import ds_to_universal

    args = ds_to_universal.parse_arguments()
    num_experts = _num_experts(args.input_folder)
    if num_experts:
        aggregate = getattr(ds_to_universal, "_aggregate_autoep_zero12_metadata", None)
        if aggregate is None:  # the one DeepSpeed function this relies on (0.19.8's)
            sys.exit("this DeepSpeed's ds_to_universal has no _aggregate_autoep_zero12_metadata: the experts of an "
                     "expert-parallel checkpoint cannot be added to its merge")

        def with_every_expert(metadata):
            shapes_by_file, *rest = aggregate(metadata)
            return [complete_expert_shapes(shapes, num_experts) for shapes in shapes_by_file], *rest

        ds_to_universal._aggregate_autoep_zero12_metadata = with_every_expert
    ds_to_universal.main(args)


if __name__ == "__main__":
    exit_process(main())
