"""torchrun entry for test_signals: the real app (`main`) with faults planted by variables:

- KILL_SAVE_DIR: rank 0 SIGKILLs itself inside the DCP write of the checkpoint whose folder
  ends with it (after its data files are on disk, before the metadata, the rename and the
  latest file): a job killed mid-save.
- SLOW_SAVE_DIR: every rank's write of that checkpoint first sleeps SLOW_SAVE_S seconds
  (default 3) and then says `slow write of <folder> finished`: with --async-save, the
  writer thread is still busy when the loop ends.
- NAN_AT_ITERATION: the model's output (so the loss) is NaN in that iteration.
- RAISE_AT_ITERATION (with RAISE_ON_RANK, default 1): that rank raises at the start of that
  iteration, before any of its collectives; the other ranks wait for it.
"""

import os
import signal
import sys
import time

from torch.distributed.checkpoint import FileSystemWriter

import pentatron.pretrain.checkpointing.async_save as async_save_module
import pentatron.pretrain.checkpointing.save as save_module
import pentatron.pretrain.pretrain_gpt as app
from pentatron.pretrain.training import loop

RANK = int(os.environ["RANK"])


class _FaultyWriter(FileSystemWriter):
    def write_data(self, plan, planner):
        path = str(self.path)
        slow = os.environ.get("SLOW_SAVE_DIR")
        if slow and path.endswith(slow):
            time.sleep(float(os.environ.get("SLOW_SAVE_S", "3")))
        future = super().write_data(plan, planner)
        kill = os.environ.get("KILL_SAVE_DIR")
        if kill and path.endswith(kill) and RANK == 0:
            future.wait()  # this rank's chunks are written: die in the middle of the save
            os.kill(os.getpid(), signal.SIGKILL)
        if slow and path.endswith(slow):
            future.wait()
            print(f"slow write of {os.path.basename(path)} finished", flush=True)
        return future


save_module.FileSystemWriter = _FaultyWriter
async_save_module.FileSystemWriter = _FaultyWriter

_iteration = 0
_real_train_step = loop.train_step


def _counting_train_step(*args, **kwargs):
    global _iteration
    _iteration += 1
    at, on = (
        int(os.environ.get(k, d)) for k, d in (("RAISE_AT_ITERATION", "0"), ("RAISE_ON_RANK", "1"))
    )
    if (_iteration, RANK) == (at, on):
        raise RuntimeError(f"planted error on rank {RANK} at iteration {_iteration}")
    return _real_train_step(*args, **kwargs)


loop.train_step = _counting_train_step
_real_make_forward_step = app.make_forward_step


def _make_forward_step(*args, **kwargs):
    forward_step = _real_make_forward_step(*args, **kwargs)

    def poisoned(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        if _iteration == int(os.environ.get("NAN_AT_ITERATION", "0")):
            output = output * float("nan")
        return output, loss_func

    return poisoned


app.make_forward_step = _make_forward_step
sys.exit(app.main())
