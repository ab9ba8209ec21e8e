"""zerolab: ZeRO stages 1-3 and FSDP, built small enough to read and measured on real processes.

The public contract (see README and the course notebooks):

    results = zerolab.launch(fn, world_size=2, args=(...))
    engine = zerolab.ZeRO3(model, torch.optim.AdamW, lr=1e-3)     # also DDP, ZeRO1, ZeRO2
    with zerolab.record_comm() as log: ...
    with zerolab.track_memory(engine.state_tensors) as mem: ...

Plotting (matplotlib) and widgets (ipywidgets) live in `zerolab.plots` / `zerolab.widgets` and
are imported on demand, so that spawned worker processes start fast.
"""

from zerolab import models
from zerolab.comm import CommEvent, CommLog, record_comm
from zerolab.ddp import DDP
from zerolab.hsdp import HSDP
from zerolab.launch import LaunchError, LaunchTimeout, WorkerError, init_from_env, launch
from zerolab.memory import MemoryTrace, distinct_bytes, model_state_bytes, track_memory
from zerolab.zero1 import ZeRO1, ZeRO1AfterBackward, ZeRO1Naive
from zerolab.zero2 import ZeRO2, ZeRO2Naive
from zerolab.zero3 import ZeRO3

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "HSDP",
    "ZeRO1",
    "ZeRO1AfterBackward",
    "ZeRO1Naive",
    "ZeRO2",
    "ZeRO2Naive",
    "ZeRO3",
    "CommEvent",
    "CommLog",
    "LaunchError",
    "LaunchTimeout",
    "MemoryTrace",
    "WorkerError",
    "distinct_bytes",
    "init_from_env",
    "launch",
    "models",
    "model_state_bytes",
    "record_comm",
    "track_memory",
]
