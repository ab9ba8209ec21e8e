"""Join a job that torchrun started, and what every rank of any job needs to know of its place.

    ctx = zerolab.init_from_env()   # RANK, WORLD_SIZE, LOCAL_RANK... from torchrun's environment
    ...                             # train
    zerolab.launcher.finish_torchrun_job()

The same training function then runs on one laptop (zerolab.launch) or on many nodes.
"""

from __future__ import annotations

import datetime
import os
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist

from zerolab.launcher.allocator import keep_freed_memory


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job. Returned by `init_from_env()`."""

    rank: int  # global rank, 0..world_size-1
    world_size: int  # number of processes in the job
    local_rank: int  # rank on this node: picks the GPU
    backend: str  # "gloo" or "nccl"
    device: torch.device  # cuda:local_rank with NCCL, else cpu


def default_threads(world_size: int) -> int:
    """Torch threads per rank so that the ranks share the cores instead of fighting over them."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def choose_backend(world_size: int, backend: str | None) -> str:
    """None -> NCCL when there is one GPU per rank, else gloo on CPU. Errors before spawning."""
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend is None:
        backend = "nccl" if gpus >= world_size else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo', 'nccl' or None, got {backend!r}")
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but this machine "
            f"has {gpus} GPU(s). Use backend='gloo' (CPU) or a smaller world_size.")
    return backend


def all_reach(store: dist.Store, point: str, rank: int, world_size: int,
               timeout: float) -> None:
    """Wait until every rank has reached `point`. Through the store, not a collective: it works
    whatever collectives the function left unfinished, and after it destroyed its group."""
    store.set(f"zerolab/{point}/{rank}", "1")
    store.wait([f"zerolab/{point}/{r}" for r in range(world_size)],
               datetime.timedelta(seconds=timeout))



def finish_torchrun_job(timeout: float = 300.0) -> None:
    """Under torchrun: wait until every rank gets here, then destroy the process group.

    As at the end of a `launch`, through a store rather than a collective: a gloo barrier
    returns on one rank while its last message to a peer may still be in flight, and a rank
    that then tears its connections down could make that peer abort at exit ("terminate
    called without an active exception", seen in 1 of 12-20 torchrun runs). The store is
    torchrun's own, reached as a client at MASTER_ADDR:MASTER_PORT, under keys of this run.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                           is_master=False, timeout=datetime.timedelta(seconds=timeout))
    run = (f"zerolab/{os.environ.get('TORCHELASTIC_RUN_ID', 'job')}/"
           f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    all_reach(dist.PrefixStore(run, client), "finished", rank, world_size, timeout)
    dist.destroy_process_group()


def init_from_env(backend: str | None = None, threads: int | None = None) -> DistContext:
    """Join the job torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    Also works when the process group is already up (inside `launch`). Returns where this
    process sits; with NCCL, the current CUDA device is set to cuda:LOCAL_RANK.
    """
    if not dist.is_initialized():
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
        if backend is None:
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            backend = "nccl" if gpus >= local_world else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        torch.set_num_threads(threads or default_threads(local_world))
        keep_freed_memory()
        if "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend)
        else:  # a plain `python script.py`: a one-process job
            rendezvous = "file://" + os.path.join(tempfile.mkdtemp(), "rendezvous")
            dist.init_process_group(backend, init_method=rendezvous, rank=0, world_size=1)
    backend = dist.get_backend()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, backend, device)
