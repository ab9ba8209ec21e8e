"""`python -m zerolab.train`: under torchrun and spawned by itself, the loss goes down.

Both launches train on the same global batches, so their losses agree whatever the engine
(world size 2: the engines are bitwise equal to torch DDP, see test_engines.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerolab import train
from zerolab.data import BUILTIN_TEXT, CharTokenizer, Corpus

REPO = Path(__file__).resolve().parent.parent
STEPS = 8


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def run(args: list[str], tmp_path: Path, name: str) -> tuple[subprocess.CompletedProcess, dict]:
    json_path = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, *args, "--json", str(json_path)], capture_output=True,
                          text=True, timeout=300, cwd=REPO, env=subprocess_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(json_path.read_text())


@pytest.fixture(scope="module")
def torchrun_zero3(tmp_path_factory):
    return run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "zerolab.train", "--engine", "zero3", "--steps", str(STEPS)],
               tmp_path_factory.mktemp("torchrun"), "zero3")


def test_torchrun_zero3_loss_goes_down(torchrun_zero3):
    proc, result = torchrun_zero3
    losses = result["losses"]
    assert len(losses) == STEPS
    assert losses[-1] < losses[0]
    assert result["world_size"] == 2 and result["config"]["engine"] == "zero3"
    assert "trained zero3 on 2 rank(s)" in proc.stdout  # rank 0 alone prints the summary
    assert proc.stdout.count("trained zero3") == 1


def test_torchrun_summary_has_every_rank(torchrun_zero3):
    _, result = torchrun_zero3
    assert [s["rank"] for s in result["ranks"]] == [0, 1]
    for s in result["ranks"]:
        assert s["sent_bytes_per_step"] > 0
        assert set(s["sent_by_op_per_step"]) == {"all_gather", "reduce_scatter"}
        assert 0 < sum(s["model_state_bytes"].values()) <= s["peak_bytes"]


def test_spawned_world_size_2_with_trace(tmp_path, torchrun_zero3):
    trace = tmp_path / "trace.json"
    proc, result = run(["-m", "zerolab.train", "--engine", "zero2", "--world-size", "2",
                        "--steps", str(STEPS), "--trace", str(trace)], tmp_path, "zero2")
    losses = result["losses"]
    assert losses[-1] < losses[0]
    assert "train zero2 [" in proc.stderr  # the progress bar
    # Same batches, same initial weights: the same losses as ZeRO-3 under torchrun.
    assert losses == pytest.approx(torchrun_zero3[1]["losses"], rel=1e-5)
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["pid"] for e in events} == {0, 1}
    names = {e["name"] for e in events}
    assert {"forward", "backward", "step"} <= names
    assert any(e.get("cat") == "reduce_scatter" for e in events)


def test_char_tokenizer_round_trip():
    tok = CharTokenizer.from_text(BUILTIN_TEXT)
    ids = tok.encode("Alice was")
    assert ids.dtype == torch.long
    assert tok.decode(ids) == "Alice was"
    assert tok.vocab_size == len(set(BUILTIN_TEXT))


def test_corpus_batches_are_shifted_and_deterministic():
    corpus = Corpus.builtin()
    x, y = corpus.batch(4, 32, seed=3)
    assert x.shape == y.shape == (4, 32)
    assert torch.equal(x[:, 1:], y[:, :-1])  # the target is the next character
    x2, _ = corpus.batch(4, 32, seed=3)
    assert torch.equal(x, x2)
    with pytest.raises(ValueError, match="block_size"):
        corpus.batch(1, len(corpus.tokens), seed=0)


def test_no_rank_tears_a_torchrun_job_down_before_every_rank_ends(tmp_path):
    """finish_torchrun_job meets through torchrun's store: rank 0 waits for the late rank 1
    (1.5 s) before it destroys its group; both end with no group."""
    out = tmp_path / "finish"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2",
                           str(REPO / "tests" / "workers" / "finish_torchrun.py"),
                           str(out)], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)]
    assert ranks[0]["waited_s"] >= 1.2 and ranks[1]["waited_s"] < 1.2
    assert not ranks[0]["group_left"] and not ranks[1]["group_left"]


# --- the command line refuses what cannot work, before anything trains -----------------------


@pytest.mark.parametrize("argv, text", [
    (["--batch-size", "0"], "argument --batch-size: must be a positive integer, got 0"),
    (["--steps", "-3"], "argument --steps: must be a positive integer, got -3"),
    (["--log-every", "0"], "argument --log-every: must be a positive integer, got 0"),
    (["--world-size", "0"], "argument --world-size: must be a positive integer, got 0"),
    (["--n-head", "3"], "n_head=3 must divide n_embd=64"),
    (["--n-embd", "30", "--n-head", "4"], "n_head=4 must divide n_embd=30"),
    (["--lr", "nan"], "argument --lr: must be a positive number, got nan"),
    (["--lr", "0"], "argument --lr: must be a positive number, got 0"),
    (["--block-size", "100000"], "block_size=100000 needs a text longer than the built-in"),
    (["--engine", "zero9"], "argument --engine: invalid choice: 'zero9'"),
    (["--backend", "nccl", "--world-size", "64"], "backend='nccl' needs one GPU per rank"),
])
def test_bad_arguments_are_usage_errors(argv, text, capsys):
    with pytest.raises(SystemExit) as info:
        train.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m zerolab.train"), err
    assert text in err, err


def test_output_paths_are_checked_before_training(tmp_path, capsys, monkeypatch):
    cases = [(["--json", str(tmp_path / "missing" / "out.json")],
              f"cannot write {tmp_path / 'missing' / 'out.json'}: No such file or directory"),
             (["--trace", str(tmp_path)], f"{tmp_path} is a directory, not a file to write"),
             (["--json", str(tmp_path / "a"), "--trace", str(tmp_path / "a")],
              f"--trace and --json both write {tmp_path / 'a'}")]
    for argv, text in cases:
        with pytest.raises(SystemExit) as info:
            train.parse_args(argv)
        assert info.value.code == 2 and text in capsys.readouterr().err
    # A writable path passes, and the check leaves no file behind.
    config = train.parse_args(["--json", str(tmp_path / "out.json")])
    assert config.json == str(tmp_path / "out.json") and not (tmp_path / "out.json").exists()
    # Under torchrun only rank 0 writes them, so only rank 0 checks.
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train.parse_args(["--json", str(tmp_path / "missing" / "x")]).json


def test_a_bad_path_stops_the_command_before_it_trains(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "zerolab.train", "--steps", "2",
                           "--json", str(tmp_path / "missing" / "out.json")],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env=subprocess_env())
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot write" in proc.stderr and "train zero3 [" not in proc.stderr
    assert proc.stdout == ""


def test_a_config_checks_itself_too():
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0; n_head"):
        train.run(train.TrainConfig(batch_size=0, n_head=5))
