"""``train(RunConfig)`` for one torchrun worker, the config given as JSON: how the tests start
runs that the CLI refuses (resuming on fewer processes with a larger per-rank batch) and runs
killed in the middle of a save::

    python -m torch.distributed.run --nproc-per-node 2 tests/train/torchrun_train.py CONFIG_JSON [KILL_STEP]

With KILL_STEP every rank kills itself (SIGKILL, no clean-up) as soon as it has written its
shards of checkpoint KILL_STEP, before the checkpoint is complete.
"""

from __future__ import annotations

import json
import os
import signal
import sys

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from openk3.train.config import RunConfig
from openk3.train.trainer import train


def die_after_writing_shards(step: int) -> None:
    write_data = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        written = write_data(self, plan, planner)
        if f".step_{step:06d}." in str(self.path):  # the save's temporary directory
            written.wait()
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    FileSystemWriter.write_data = write_then_die


if __name__ == "__main__":
    if len(sys.argv) > 2:
        die_after_writing_shards(int(sys.argv[2]))
    train(RunConfig.from_dict(json.loads(sys.argv[1])))
