"""Run ``llama-megatron ARGS`` in this process, then print one JSON line with its exit code and peak RSS.

``--idle`` only imports what the converter imports and exits: the fixed overhead to compare against.
Peak RSS is ``VmHWM`` from /proc/self/status: it belongs to this process image alone, whereas ``ru_maxrss``
also carries the high-water mark of the (possibly large) parent this process was forked from.
"""

import json
import sys


def peak_rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    import llama_megatron.commands.convert  # noqa: F401  (the same imports in both modes)
    import llama_megatron.commands.export  # noqa: F401
    import llama_megatron.commands.reshard  # noqa: F401
    from llama_megatron.cli import main

    rc = 0 if sys.argv[1:] == ["--idle"] else main(sys.argv[1:])
    print(json.dumps({"rc": rc, "peak_rss": peak_rss_bytes()}), flush=True)
    sys.exit(rc)
