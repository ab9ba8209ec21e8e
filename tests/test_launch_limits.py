"""What zerolab.launch refuses before any rank starts, how long it lets ranks run, and where
they listen."""

import math
import os
import socket
import time

import launch_helpers
import psutil
import pytest
import torch
from workers import launch as launch_workers

import zerolab
from zerolab.launcher import local, torchrun

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def no_leftover_ranks():
    before = {p.pid for p in launch_helpers.spawned_children()}
    yield
    left = [p for p in launch_helpers.spawned_children() if p.pid not in before]
    assert not left, f"processes left behind: {[(p.pid, p.status()) for p in left]}"


# --- errors before anything spawns ------------------------------------------------------------


@pytest.fixture
def forbid_spawn(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("launch started processes before validating its arguments")

    monkeypatch.setattr(local, "_start", fail)


@pytest.mark.parametrize("world_size", [0, -1, 1.5, "2", None, True])
def test_bad_world_size_is_refused_before_spawning(world_size, forbid_spawn):
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        zerolab.launch(launch_workers.rank_and_size, world_size)


def test_nccl_with_more_ranks_than_gpus_is_refused_before_spawning(forbid_spawn):
    with pytest.raises(ValueError, match=rf"one GPU per rank.*has {GPUS} GPU"):
        zerolab.launch(launch_workers.rank_and_size, GPUS + 1, backend="nccl")


def test_unknown_backend_is_refused(forbid_spawn):
    with pytest.raises(ValueError, match="backend must be"):
        zerolab.launch(launch_workers.rank_and_size, 1, backend="mpi")


def test_backend_choice(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert torchrun.choose_backend(4, None) == "gloo"
    assert torchrun.choose_backend(1, "gloo") == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert torchrun.choose_backend(4, None) == "nccl"  # one GPU per rank
    assert torchrun.choose_backend(5, None) == "gloo"  # not enough GPUs: CPU
    assert torchrun.choose_backend(2, "gloo") == "gloo"  # asked for explicitly
    with pytest.raises(ValueError, match="world_size=5 but this machine has 4 GPU"):
        torchrun.choose_backend(5, "nccl")


def test_default_threads_share_the_cores(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert [torchrun.default_threads(n) for n in (1, 2, 3, 4, 8, 16)] == [8, 4, 2, 2, 1, 1]


def _nested_function():
    def inner():
        return 1

    return inner


@pytest.mark.parametrize("fn", [lambda: 1, _nested_function()], ids=["lambda", "nested"])
def test_unimportable_function_is_refused(fn, forbid_spawn):
    with pytest.raises(ValueError, match="top level of a module"):
        zerolab.launch(fn, 2)


@pytest.mark.parametrize("timeout", [-5, 0, math.nan, math.inf, "10", True, [3]])
def test_bad_timeouts_are_refused_before_spawning(timeout, forbid_spawn):
    with pytest.raises(ValueError, match=r"timeout must be a positive number of seconds \(how "
                                         r"long the ranks may go without progress"):
        zerolab.launch(launch_workers.rank_and_size, 1, timeout=timeout)


@pytest.mark.parametrize("threads", [0, -1, 1.5, "2", True])
def test_bad_threads_are_refused_before_spawning(threads, forbid_spawn):
    with pytest.raises(ValueError, match="threads must be a positive integer or None"):
        zerolab.launch(launch_workers.rank_and_size, 1, threads=threads)


@pytest.mark.parametrize("args, text", [
    (5, "args must be a tuple (or list) of fn's arguments, got int 5: for one argument write "
        "args=(x,)"),
    ("ab", "args must be a tuple (or list) of fn's arguments, got str 'ab'"),
    ((1, launch_workers.Unpicklable()),
     "args[1] (Unpicklable) cannot be sent to the ranks, which receive their arguments "
     "pickled: this object refuses to be pickled"),
])
def test_bad_args_are_refused_before_spawning(args, text, forbid_spawn):
    with pytest.raises(ValueError) as info:
        zerolab.launch(launch_workers.rank_and_size, 1, args=args)
    assert str(info.value).startswith(text), str(info.value)


# --- how long ranks may run ------------------------------------------------------------------


def test_a_job_longer_than_its_timeout_that_makes_progress_is_not_stopped(no_leftover_ranks):
    """The timeout is one of idleness: 3 s of computing on rank 1 (rank 0 waiting), then 6
    all-reduces 0.5 s apart, under timeout=1.5: about 6 s in all, never 1.5 s idle."""
    start = time.perf_counter()
    results = zerolab.launch(launch_workers.slow_but_progressing, 2, args=(3.0, 6, 0.5),
                             timeout=1.5)
    assert results == [2.0 ** 7, 2.0 ** 7]  # 7 all-reduces of ones on 2 ranks
    assert time.perf_counter() - start > 1.5 * 3


def test_no_timeout_at_all():
    assert zerolab.launch(launch_workers.rank_and_size, 2, timeout=None, threads=1) == [
        (0, 2, 1), (1, 2, 1)]


# --- where ranks listen ----------------------------------------------------------------------


def network_interface() -> str | None:
    """An interface with an IPv4 address other than loopback, if this machine has one."""
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and not a.address.startswith("127.")
               for a in addresses):
            return name
    return None


def test_ranks_listen_on_the_loopback_interface_only(monkeypatch, no_leftover_ranks):
    """gloo listens on what the hostname resolves to (in a container, often the network), or
    on GLOO_SOCKET_IFNAME, which a user sets for jobs across machines: a launch on one machine
    listens on 127.0.0.1 whatever they say."""
    interface = network_interface()
    if interface:  # the caller asks for the network: the ranks must not follow
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", interface)
    for addresses in zerolab.launch(launch_workers.listening_addresses, 2):
        assert addresses == ["127.0.0.1"], (interface, addresses)
