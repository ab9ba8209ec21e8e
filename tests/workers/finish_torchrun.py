"""Run by test_train.py under torchrun: rank 1 is late to the end of the job; every rank writes
how long `finish_torchrun_job` kept it and whether the group was gone after."""

import json
import sys
import time

import torch.distributed as dist

import zerolab
from zerolab.launcher import finish_torchrun_job

ctx = zerolab.init_from_env()
if ctx.rank == 1:
    time.sleep(1.5)  # still busy while rank 0 wants to tear the job down
start = time.perf_counter()
finish_torchrun_job()
with open(f"{sys.argv[1]}.{ctx.rank}", "w") as f:
    json.dump({"waited_s": time.perf_counter() - start, "group_left": dist.is_initialized()}, f)
