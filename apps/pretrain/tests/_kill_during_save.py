"""torchrun entry for test_signals: the real app, except that rank 0 SIGKILLs itself inside
the DCP write of the checkpoint whose folder ends with $KILL_SAVE_DIR (after its data files
are on disk, before the metadata, the rename and the latest file): a job killed mid-save."""

import os
import signal
import sys

from torch.distributed.checkpoint import FileSystemWriter

import pentatron.pretrain.checkpointing.save as save_module
from pentatron.pretrain.pretrain_gpt import main


class _KillingWriter(FileSystemWriter):
    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        if str(self.path).endswith(os.environ["KILL_SAVE_DIR"]) and os.environ["RANK"] == "0":
            future.wait()  # this rank's chunks are written: die in the middle of the save
            os.kill(os.getpid(), signal.SIGKILL)
        return future


save_module.FileSystemWriter = _KillingWriter
sys.exit(main())
