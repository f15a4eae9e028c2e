"""Train, but SIGKILL this process in the middle of saving the checkpoint of step CRASH_AT_STEP.

The kill lands after DeepSpeed has written the new checkpoint's files and before it is published
(renamed and named in `latest`): the moment a real crash would do the most damage.
"""

import os
import signal
import sys

from llama_megatron import train
from llama_megatron.training import checkpointing

crash_tag = checkpointing.step_tag(int(os.environ["CRASH_AT_STEP"]))
write = checkpointing.write_text_atomic


def write_then_maybe_die(path: str, text: str) -> None:
    if crash_tag in path and path.endswith(checkpointing.META_FILE):
        os.kill(os.getpid(), signal.SIGKILL)
    write(path, text)


checkpointing.write_text_atomic = write_then_maybe_die
sys.exit(train.main(sys.argv[1:]))
