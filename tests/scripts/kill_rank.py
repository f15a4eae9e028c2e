"""Train, but with KILL_AT_STEP set, SIGKILL rank KILL_RANK (default 1) as it starts that optimizer step.

The other ranks are left waiting in a collective of the same step, as when a node dies mid-run; the launcher
then takes the job down. Without KILL_AT_STEP this is plain `llama_megatron.train` (the restarted job).
"""

import os
import signal
import sys

from llama_megatron import train
from llama_megatron.training.engine.training_engine import TrainingEngine

if os.environ.get("KILL_AT_STEP") and os.environ.get("RANK") == os.environ.get("KILL_RANK", "1"):
    kill_at = int(os.environ["KILL_AT_STEP"])
    train_step = TrainingEngine.train_step

    def train_step_or_die(self, micro_batches):
        if self.engine.global_steps + 1 == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return train_step(self, micro_batches)

    TrainingEngine.train_step = train_step_or_die

sys.exit(train.main(sys.argv[1:]))
