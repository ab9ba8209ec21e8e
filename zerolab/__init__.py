"""zerolab: ZeRO stages 1-3 and FSDP, built small enough to read and measured on real processes.

The public contract (see README and the course notebooks):

    results = zerolab.launch(fn, world_size=2, args=(...))
    engine = zerolab.ZeRO3(model, torch.optim.AdamW, lr=1e-3)     # also DDP, ZeRO1, ZeRO2
    with zerolab.record_comm() as log: ...
    with zerolab.track_memory(engine.state_tensors) as mem: ...

The lesson sits here, one file per idea: the engines (ddp.py -> zero1.py -> zero2.py -> zero3.py,
then hsdp.py and zeropp.py), comm.py (every collective), sharding.py and units.py (what a rank
holds), memory.py and activations.py (measured), theory.py (the formulas), engines.py (the
contract every engine keeps, and the registry), harness.py (one measured step), checkpoint.py,
models.py and data.py. The plumbing is in folders by role: launcher/ (ranks), wire/ (bytes on
the wire), parts/ (what engines are built from), plots/ (every figure; imported on demand, so
that ranks start fast), bench/ (`python -m zerolab.bench`), grading/ and lessons/.
"""

from zerolab import models
from zerolab.comm import CommEvent, CommLog, record_comm
from zerolab.ddp import DDP, DDPAfterBackward
from zerolab.engines import Engine, ShardedEngine
from zerolab.hsdp import HSDP
from zerolab.launcher import (
    CollectiveMismatch,
    LaunchError,
    LaunchTimeout,
    WorkerError,
    init_from_env,
    launch,
)
from zerolab.memory import MemoryTrace, distinct_bytes, model_state_bytes, track_memory
from zerolab.zero1 import ZeRO1, ZeRO1AfterBackward, ZeRO1AllReduce
from zerolab.zero2 import ZeRO2, ZeRO2AfterBackward
from zerolab.zero3 import ZeRO3
from zerolab.zeropp import ZeroPP

__version__ = "0.1.0"

__all__ = [
    "DDP",
    "DDPAfterBackward",
    "HSDP",
    "ZeRO1",
    "ZeRO1AfterBackward",
    "ZeRO1AllReduce",
    "ZeRO2",
    "ZeRO2AfterBackward",
    "ZeRO3",
    "ZeroPP",
    "CollectiveMismatch",
    "CommEvent",
    "CommLog",
    "Engine",
    "LaunchError",
    "LaunchTimeout",
    "MemoryTrace",
    "ShardedEngine",
    "WorkerError",
    "distinct_bytes",
    "init_from_env",
    "launch",
    "models",
    "model_state_bytes",
    "record_comm",
    "track_memory",
]
