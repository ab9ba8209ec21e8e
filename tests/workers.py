"""Worker functions for the tests: spawned ranks import them from here."""

import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

from zerolab import comm


def rank_and_size():
    return dist.get_rank(), dist.get_world_size(), torch.get_num_threads()


def all_reduce_rank():
    t = torch.tensor([float(dist.get_rank() + 1)])
    comm.all_reduce(t, tag="test/all_reduce")
    return t


def return_tensors(n):
    return {"rank": dist.get_rank(), "t": torch.arange(n) * dist.get_rank(), "nested": [torch.ones(2)]}


def raise_on(rank):
    if dist.get_rank() == rank:
        raise KeyError(f"boom from {rank}")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the others wait here for the rank that raised
    return t


def hang_on(rank):
    if dist.get_rank() == rank:
        time.sleep(600)
    t = torch.zeros(1)
    dist.all_reduce(t)
    return t


def exit_hard(rank):
    if dist.get_rank() == rank:
        os._exit(3)
    return dist.get_rank()


def noisy():
    print("hello from a rank")
    print("to stderr", file=sys.stderr)
    warnings.warn("a warning from a rank")
    return dist.get_rank()


def pid():
    return os.getpid()
