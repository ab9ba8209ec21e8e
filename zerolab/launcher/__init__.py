"""The launcher: run a function on N real processes, or join a job torchrun started.

    results = zerolab.launch(fn, world_size=2, args=(x,))   # local.py: ranks on this machine
    ctx = zerolab.init_from_env()                           # torchrun.py: a rank of its job

- local.py starts the ranks (forked by zygote.py, or spawned by spawn.py where no zygote runs),
  waits for them, and brings their results back; diagnose.py says what went wrong when a rank
  fails or hangs, hangs.py whether ranks still make progress, where each one is and the first
  collective at which they parted (from their flight recorders, zerolab/wire/flight.py),
  fingerprints.py whether the ranks passed the same things to each call;
  leftovers.py makes sure nothing outlives a launch (processes, folders, logs).
- allocator.py makes every rank keep the host memory it frees; progress.py draws a progress bar
  in the caller for work done on rank 0.
"""

from zerolab.launcher.diagnose import CollectiveMismatch, LaunchError, LaunchTimeout, WorkerError
from zerolab.launcher.local import launch, running_ranks
from zerolab.launcher.torchrun import (
    DistContext,
    choose_backend,
    finish_torchrun_job,
    init_from_env,
)

__all__ = ["CollectiveMismatch", "DistContext", "LaunchError", "LaunchTimeout", "WorkerError",
           "choose_backend", "finish_torchrun_job", "init_from_env", "launch", "running_ranks"]
