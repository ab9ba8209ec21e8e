"""zerolab.launch: spawned ranks, results back, errors, timeouts, quiet workers, torchrun."""

import importlib
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import launch_helpers
import psutil
import pytest
import torch
from workers import launch as launch_workers

import zerolab
from zerolab.launcher import local

REPO = Path(__file__).resolve().parent.parent
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.fixture
def no_leftover_ranks():
    before = {p.pid for p in launch_helpers.spawned_children()}
    yield
    left = [p for p in launch_helpers.spawned_children() if p.pid not in before]
    assert not left, f"processes left behind: {[(p.pid, p.status()) for p in left]}"


def subprocess_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return env


# --- results ----------------------------------------------------------------------------------


def test_two_rank_all_reduce(record_property, no_leftover_ranks):
    start = time.perf_counter()
    results = zerolab.launch(launch_workers.all_reduce_rank, world_size=2)
    wall = time.perf_counter() - start
    # Not asserted (machines differ): reported with `pytest -rP` and in the junit XML.
    record_property("launch_2rank_all_reduce_wall_s", round(wall, 3))
    print(f"launch of a 2-rank all-reduce: {wall:.2f} s wall")
    assert len(results) == 2
    for t in results:
        assert torch.equal(t, torch.tensor([3.0]))  # 1 + 2


def test_results_ordered_by_rank_with_tensors_intact(no_leftover_ranks):
    n, world_size = 5, 3
    payload = {"t": torch.arange(4.0).view(2, 2), "big": torch.ones(1 << 18), "s": "text"}
    results = zerolab.launch(launch_workers.describe, world_size, args=(n, payload))
    assert [r["rank"] for r in results] == [0, 1, 2]
    cores = len(os.sched_getaffinity(0))
    for rank, r in enumerate(results):
        assert r["world_size"] == world_size
        assert r["backend"] == "gloo"  # no GPU here, or fewer than ranks: gloo on CPU
        assert r["env"] == {"RANK": str(rank), "WORLD_SIZE": "3", "LOCAL_RANK": str(rank)}
        ctx = r["context"]
        assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.backend) == (rank, 3, rank, "gloo")
        assert ctx.device == torch.device("cpu")
        # Ranks share the cores instead of each taking all of them.
        assert r["threads"] == max(1, cores // world_size)
        # Tensors of every kind come back with their values, dtypes and shapes.
        assert torch.equal(r["float"], torch.arange(n, dtype=torch.float32) * rank)
        assert r["int64"].dtype == torch.int64
        assert r["int64"].tolist() == [10**12 + i for i in range(n)]
        assert r["bf16"].dtype == torch.bfloat16
        assert r["bf16"].tolist() == [1.5 + rank] * n
        assert torch.equal(r["transposed"], torch.arange(6.0).view(2, 3).t())
        assert r["requires_grad"].requires_grad
        assert r["requires_grad"].tolist() == [float(rank)] * 3
        assert r["big"].shape == (1 << 20,)
        assert bool((r["big"] == rank).all())
        assert torch.equal(r["nested"][0], torch.ones(2) * rank)
        assert torch.equal(r["nested"][1][0], torch.zeros(1))
        # Arguments with tensors reach every rank intact.
        assert r["payload"]["s"] == "text"
        assert torch.equal(r["payload"]["t"], payload["t"])
        assert torch.equal(r["payload"]["big"], payload["big"])
        # A view comes back as a view of its base (one storage), not as a separate copy.
        assert r["view"].tolist() == [2.0 * rank, 3.0 * rank, 4.0 * rank]
        base_ptr = r["base"].untyped_storage().data_ptr()
        assert r["view"].untyped_storage().data_ptr() == base_ptr
        r["base"][3] = -1.0
        assert r["view"][1].item() == -1.0
    # Three distinct processes, all gone now that launch has returned.
    pids = [r["pid"] for r in results]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert not any(psutil.pid_exists(p) for p in pids)


def test_world_size_one():
    assert zerolab.launch(launch_workers.rank_and_size, world_size=1, threads=1) == [(0, 1, 1)]


def test_a_function_that_destroys_its_own_group(no_leftover_ranks):
    """The same training function runs under torchrun (where it cleans up after itself) and
    under launch: tearing down the group is the function's right, not an error."""
    assert zerolab.launch(launch_workers.destroys_its_group, 2) == [0, 1]


def test_two_launches_at_once_do_not_collide(monkeypatch, no_leftover_ranks):
    """Each launch has its own rendezvous: two at once (threads here) both finish correctly."""
    # A MASTER_ADDR/PORT left in the environment (e.g. by torchrun) must not be what is used.
    monkeypatch.setenv("MASTER_ADDR", "203.0.113.1")  # TEST-NET-3: unroutable
    monkeypatch.setenv("MASTER_PORT", "1")
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(value):
        try:
            results[value] = zerolab.launch(launch_workers.all_reduce_value, 2, args=(value,))
        except BaseException as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(v,)) for v in (1, 10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert [t.item() for t in results[1]] == [3.0, 3.0]  # 1*1 + 1*2
    assert [t.item() for t in results[10]] == [30.0, 30.0]  # 10*1 + 10*2


# --- in a notebook --------------------------------------------------------------------------


def test_in_a_notebook_kernel(tmp_path, monkeypatch):
    """In a real Jupyter kernel: a function defined in a cell is refused with a message that
    says to put it in a module; one imported from a module runs, and the cell shows only what
    the caller printed (a kernel forwards even raw file-descriptor output to the notebook)."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(textwrap.dedent("""
            import zerolab

            def my_worker():
                return 1

            try:
                zerolab.launch(my_worker, 2)
            except ValueError as e:
                print("REFUSED:", e)
        """)),
        nbformat.v4.new_code_cell(textwrap.dedent(f"""
            import sys
            sys.path.insert(0, {str(Path(__file__).parent)!r})
            from workers import launch as launch_workers
            print(zerolab.launch(launch_workers.noisy, 2))
        """)),
    ]
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    refused, ran = ("".join(o.get("text", "") for o in c.outputs) for c in nb.cells)
    assert refused.startswith("REFUSED:"), refused
    assert "my_worker" in refused and "notebook" in refused and "module" in refused
    assert "from my_workers import my_worker" in refused
    assert ran == "[0, 1]\n"


# --- errors from running ranks ----------------------------------------------------------------


def test_a_rank_that_raises(no_leftover_ranks):
    start = time.perf_counter()
    with pytest.raises(zerolab.WorkerError) as info:
        # The other rank waits in an all-reduce that will never complete.
        zerolab.launch(launch_workers.raise_on, 2, args=(1,), timeout=600)
    elapsed = time.perf_counter() - start
    err = info.value
    assert isinstance(err, zerolab.LaunchError)
    assert err.rank == 1
    message = str(err)
    assert message.startswith("rank 1 raised KeyError: 'boom from 1'")
    assert "Traceback" in message
    assert "workers/launch.py" in message and "raise_on" in message  # the worker's own frames
    # Not left to the timeout: ended as soon as rank 1 failed (the bound leaves room for a
    # loaded machine, where starting two ranks alone can take half a minute).
    assert elapsed < 300, f"the waiting rank was not ended promptly ({elapsed:.1f} s)"


def test_a_rank_that_exits_without_an_exception(no_leftover_ranks):
    with pytest.raises(zerolab.WorkerError) as info:
        zerolab.launch(launch_workers.exit_hard, 2, args=(0,), timeout=60)
    assert info.value.rank == 0
    assert "rank 0 exited with code 3" in str(info.value)


def test_a_rank_stuck_in_a_collective_is_stopped_after_timeout_s_without_progress(
        no_leftover_ranks):
    start = time.perf_counter()
    with pytest.raises(zerolab.LaunchTimeout) as info:
        # Rank 1 sleeps for 10 minutes; rank 0 waits for it in an all-reduce.
        zerolab.launch(launch_workers.hang_on, 2, args=(1,), timeout=3)
    elapsed = time.perf_counter() - start
    message = str(info.value)
    # Both ranks are named, and where each one was: one waiting, the other sleeping.
    assert message.startswith("ranks [0, 1] made no progress for 3s (no collective issued or "
                              "completed, nothing printed, no CPU used) and were stopped."), message
    assert "rank 0 waits in all_reduce #1 (4 B float32, shape (1,)), called from hang_on (" \
        in message, message
    assert "rank 1 is not in a collective: it is in hang_on (" in message, message
    assert "`time.sleep(600)`" in message
    assert "rank 1 never issued #1" in message
    assert 3 <= elapsed < 30


def test_a_rank_killed_by_a_signal_names_it_and_its_usual_cause(no_leftover_ranks):
    for name, cause in [("SIGKILL", "out-of-memory killer"), ("SIGSEGV", "segmentation fault")]:
        with pytest.raises(zerolab.WorkerError) as info:
            zerolab.launch(launch_workers.kill_self_with, 2, args=(1, name), timeout=120)
        message = str(info.value)
        assert message.startswith(f"rank 1 was killed by {name} "
                                  f"(exit code -{signal.Signals[name].value}): "), message
        assert cause in message, message
    assert "in kill_self_with" in message  # where Python was at the crash (faulthandler)


def test_a_collective_with_mismatched_sizes_is_named_as_the_likely_cause(no_leftover_ranks):
    with pytest.raises(zerolab.WorkerError) as info:
        zerolab.launch(launch_workers.uneven_broadcast, 2, timeout=120)
    message = str(info.value)
    assert message.startswith("rank 1 was killed by SIGABRT (exit code -6): a native library"), \
        message
    assert "a collective called with tensors that differ across ranks" in message
    # The rank's own output: gloo's complaint, and where Python was when it aborted.
    assert re.search(r"Output of rank 1:.*gloo.*in uneven_broadcast", message, re.S), message


def test_no_rank_starts_before_every_group_is_up_nor_tears_down_before_all_end(
        tmp_path, monkeypatch, no_leftover_ranks):
    """On a busy machine one rank can lag: a peer that ran ahead, ran a function needing no
    collective and closed its connections made the laggard fail in its set-up ("Gloo
    connectFullMesh failed ... Connection closed by peer"). Here rank 1 lags on purpose."""
    monkeypatch.setenv("ZEROLAB_TEST_TIMES", str(tmp_path))
    monkeypatch.setattr(local, "_worker", launch_helpers.slow_rank_worker)
    assert zerolab.launch(launch_helpers.noted_function, 2) == [0, 1]

    def times(point):
        return launch_helpers.times(tmp_path, point, world_size=2)

    assert min(times("fn_start")) >= max(times("group_up"))
    assert min(times("teardown")) >= max(times("fn_end"))


# --- scripts, as a learner runs them --------------------------------------------------------


WORK = """\
import torch.distributed as dist
import zerolab

print("printed at the top")


def work():
    return dist.get_rank()


"""
GUARD = 'if __name__ == "__main__":\n    print(zerolab.launch(work, 2))\n'
ONLY_IN_A_RANK = ('if __name__ == "__mp_main__":  # the script, run again in a new rank\n'
                  '    raise RuntimeError("this line fails in a new process only")\n')


@pytest.mark.parametrize("source, stdin, expected", [
    (WORK + "print(zerolab.launch(work, 2))\n", False,
     ["LaunchError: zerolab.launch was called at the top level of script.py without an "
      '`if __name__ == "__main__":` guard (line 11: `print(zerolab.launch(work, 2))`)',
      'if __name__ == "__main__":\n        print(zerolab.launch(...))']),
    (WORK + GUARD, True,
     ["LaunchError: zerolab.launch cannot start ranks from a script read from standard input",
      "save the script to a file"]),
    # Not a guard, but the check before spawning cannot tell: the ranks' own output does.
    (WORK + "if True:\n    print(zerolab.launch(work, 2))\n", False,
     ["could not start: the main script calls zerolab.launch without an `if __name__",
      "Output of rank", "zerolab.launch was called while a rank ran the main script again",
      "    printed at the top"]),
    (WORK + ONLY_IN_A_RANK + GUARD, False,
     ["failed while starting, before it ran work: RuntimeError: this line fails in a new "
      "process only", 'raise RuntimeError("this line fails', "    printed at the top"]),
    (launch_helpers.SPAWNED + WORK + "if True:\n    print(zerolab.launch(work, 2))\n", False,
     ["could not start: the main script calls zerolab.launch without an `if __name__",
      "Output of rank", "finished its bootstrapping phase", "    printed at the top"]),
    (launch_helpers.SPAWNED + WORK + ONLY_IN_A_RANK + GUARD, False,
     ["failed while starting, before it ran work: RuntimeError: this line fails in a new "
      "process only", "spawn_main", "    printed at the top"]),
], ids=["no-guard", "stdin", "no-guard-seen-by-the-ranks", "fails-in-a-new-process",
        "spawned-no-guard-seen-by-the-ranks", "spawned-fails-in-a-new-process"])
def test_a_script_the_ranks_cannot_start_from_is_explained(tmp_path, source, stdin, expected):
    proc = launch_helpers.run_script(tmp_path, source, subprocess_env(), stdin=stdin)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for text in expected:
        assert text in proc.stderr, proc.stderr
    if not expected[0].startswith("LaunchError"):  # the ranks started
        # What a rank printed from its very start is in the error, not in the caller's output.
        assert proc.stdout == "printed at the top\n", proc.stdout


def test_a_guarded_script_runs_and_its_ranks_print_nothing(tmp_path):
    proc = launch_helpers.run_script(tmp_path, WORK + GUARD, subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "printed at the top\n[0, 1]\n"  # once: the ranks' copies are logged
    assert "printed at the top" not in proc.stderr


# --- quiet workers ----------------------------------------------------------------------------


def test_verbose_shows_worker_output_prefixed_by_rank(capfd):
    assert zerolab.launch(launch_workers.noisy, 2, verbose=True) == [0, 1]
    out, err = capfd.readouterr()
    for rank in (0, 1):
        assert f"[rank {rank}] hello from a rank" in out
        assert f"[rank {rank}] to stderr" in out
        assert any(f"[rank {rank}]" in line and "a warning from a rank" in line
                   for line in out.splitlines())


def test_worker_output_stays_out_of_the_callers_output(tmp_path, monkeypatch, capfd):
    """Prints and warnings of the ranks stay out of the caller's output: those of the function,
    and those of importing its module, which every rank imports again (a notebook's helper
    module that prints or warns at import, or imports something noisy)."""
    (tmp_path / "noisy_helpers.py").write_text(textwrap.dedent("""
        import sys
        import warnings

        print("printed at import")
        warnings.warn("warned at import", stacklevel=1)


        def work():
            print("printed while running")
            print("to stderr while running", file=sys.stderr)
            warnings.warn("warned while running", stacklevel=1)
            return 7
    """))
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned ranks get the caller's sys.path
    with pytest.warns(UserWarning, match="warned at import"):
        noisy_helpers = importlib.import_module("noisy_helpers")
    capfd.readouterr()  # the caller's own import printed once: not what is tested
    try:
        assert zerolab.launch(noisy_helpers.work, 2) == [7, 7]
    finally:
        sys.modules.pop("noisy_helpers", None)
    out, err = capfd.readouterr()
    for text in ("printed while running", "to stderr while running", "warned while running"):
        assert text not in out + err
    for text in ("printed at import", "warned at import"):
        assert text not in out + err, f"{text!r} from the ranks reached the caller"


# --- torchrun and GPUs ------------------------------------------------------------------------


TORCHRUN_SCRIPT = """
import torch
import torch.distributed as dist

import zerolab
from zerolab import comm

ctx = zerolab.init_from_env()
t = torch.tensor([float(ctx.rank + 1)])
comm.all_reduce(t, tag="torchrun")
print(f"RESULT rank={ctx.rank} world={ctx.world_size} local={ctx.local_rank} "
      f"backend={ctx.backend} device={ctx.device} sum={t.item():g} "
      f"threads={torch.get_num_threads()}", flush=True)
dist.destroy_process_group()
"""


def test_init_from_env_under_torchrun_and_alone(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = subprocess_env()
    env.pop("OMP_NUM_THREADS")  # torchrun sets it for its workers
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(key, None)
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                 cwd=tmp_path)
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 "--nproc-per-node", "2", str(script)], **popen)
    alone = subprocess.Popen([sys.executable, str(script)], **popen)
    try:
        torchrun_out, _ = torchrun.communicate(timeout=120)
        alone_out, _ = alone.communicate(timeout=120)
    finally:
        torchrun.kill()
        alone.kill()
    assert torchrun.returncode == 0, torchrun_out
    # The two ranks share one pipe: a rank's line may land glued to the other's, so find the
    # records rather than split lines.
    lines = sorted(re.findall(r"RESULT rank=\d+ world=\d+ local=\d+ backend=\w+ device=\w+ "
                              r"sum=\d+ threads=\d+", torchrun_out))
    cpu_threads = max(1, len(os.sched_getaffinity(0)) // 2)
    assert lines == [
        f"RESULT rank={r} world=2 local={r} backend=gloo device=cpu sum=3 threads={cpu_threads}"
        for r in (0, 1)
    ], torchrun_out
    # A plain `python job.py` is a one-process job.
    assert alone.returncode == 0, alone_out
    assert "RESULT rank=0 world=1 local=0 backend=gloo device=cpu sum=1 " in alone_out


@pytest.mark.skipif(GPUS == 0, reason="needs a CUDA GPU for NCCL; this machine has none")
def test_nccl_all_reduce_on_gpus(no_leftover_ranks):
    world_size = min(GPUS, 2)
    results = zerolab.launch(launch_workers.all_reduce_cuda, world_size)  # backend=None picks nccl
    expected = world_size * (world_size + 1) / 2
    for rank, r in enumerate(results):
        assert r["device"] == f"cuda:{rank}"
        assert r["current"] == rank
        assert r["value"].item() == expected


def test_a_failed_start_is_named_by_its_exception_not_by_output_flushed_after_it():
    """Without PYTHONUNBUFFERED a rank's stdout reaches its log at exit, after the traceback
    on stderr: the headline must still be the exception."""
    from zerolab.launcher import diagnose

    output = ("zerolab: this rank failed while starting\n"
              "Traceback (most recent call last):\n"
              '  File "script.py", line 12, in <module>\n'
              '    raise RuntimeError("this line fails in a new process only")\n'
              "RuntimeError: this line fails in a new process only\n"
              "printed at the top\n")
    assert diagnose._raised(output) == "RuntimeError: this line fails in a new process only"
    assert diagnose._raised("no traceback here\nlast line\n") == "last line"
