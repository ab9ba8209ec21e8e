"""The grader's parts that need no ranks: data sent back as data, a malformed result refused,
tampering seen (code swapped in place too), answers built on the reference told, the course's
files kept, collectives compared across ranks, a stopped run explained, the ranks' hash
seeds."""

import builtins
import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zerolab import grading
from zerolab.grading import (
    borrowed,
    call,
    course,
    crashes,
    data,
    flight,
    hosts,
    kinds,
    runner,
    session,
    tamper,
)
from zerolab.grading.check import load_module
from zerolab.grading.defaults import HASH_SEEDS
from zerolab.grading.mistakes import Evidence
from zerolab.grading.session import Stop


def test_outputs_travel_as_data(tmp_path):
    freed = torch.zeros(4)
    freed.untyped_storage().resize_(0)
    value = {"t": torch.arange(6.0).view(2, 3).t(), "freed": freed, "n": 3, "s": "x",
             "list": [1.5, None, (True, torch.tensor([1], dtype=torch.bfloat16))],
             "dtype": torch.float64, "object": object()}
    path = str(tmp_path / "x.pt")
    data.save(data.encode(value), path)
    back = data.load(path)
    assert torch.equal(back["t"], value["t"]) and back["t"].is_contiguous()
    assert back["freed"] == data.Freed((4,), "torch.float32", 0)
    assert back["n"] == 3 and back["list"][0] == 1.5 and back["list"][2][0] is True
    assert back["list"][2][1].dtype == torch.bfloat16 and back["dtype"] == "torch.float64"
    assert isinstance(back["object"], data.Described)
    assert back["object"].text.startswith("builtins.object")


def test_reading_data_runs_no_code(tmp_path):
    """A file forged with a pickled object is refused: torch.load(weights_only=True)."""
    path = str(tmp_path / "forged.pt")
    torch.save({"x": Evidence}, path)  # a class: loading it would import and build objects
    with pytest.raises(Exception, match="Weights only load failed|Unsupported"):
        data.load(path)
    refused = data.load_result(path)  # a learner's process's file: a verdict, not a traceback
    assert isinstance(refused, data.Malformed) and "forged.pt could not be read" in refused.why


def test_a_malformed_result_is_a_verdict(tmp_path):
    """What a learner's process may write in place of the grader's records: events, collectives,
    results. Each is refused as malformed, and a result judged so is WRONG, without a raise."""
    keys = {"k"}
    good = {"rank": 0, "time": 1.0, "event": "end", "key": "k", "case": 0, "status": "returned"}
    assert session._valid(good, 0, keys)
    for bad in ("all cases passed", [good], {**good, "rank": 1}, {**good, "key": "other"},
                {**good, "case": "done"}, {**good, "case": True}, {**good, "status": "passed"},
                {**good, "message": 3}, {**good, "event": "verdict"}):
        assert not session._valid(bad, 0, keys), bad
    path = tmp_path / "flight.jsonl"
    path.write_text(json.dumps(_call("all_reduce", 8, "t")) + '\n{"op": "all_reduce"}\n'
                    + json.dumps(_call("all_reduce", 8, "t")) + "\n")
    assert flight.read(str(path)) == [_call("all_reduce", 8, "t")]
    ex = grading.EXERCISES["7.1"]
    case = ex.cases()[0]
    expected = runner._plain_expected("7.1")[0][0]
    for got in ({}, {"outputs": 3}, data.Malformed("forged.pt could not be read")):
        record = runner._judge(ex, case, 1, [expected], [got])
        assert record["status"] == "wrong" and record["mistake"] == "a malformed result", got
    assert runner._judge(ex, case, 1, [expected], [expected])["status"] == "passed"


def test_code_swapped_in_place_is_seen_by_the_sealed_check(monkeypatch):
    """A function's code object or defaults swapped (the same function); and the check, taken
    before, still sees when its own module's names and builtins are rebound after."""
    check = tamper.sealed()
    before = tamper.snapshot()
    monkeypatch.setattr(kinds.run, "__code__", (lambda *a, **k: {}).__code__)
    monkeypatch.setattr(call.call, "__defaults__", (0, 1, None, None))
    monkeypatch.setattr(tamper, "snapshot", lambda: before)
    monkeypatch.setattr(tamper.replaced, "__code__", (lambda before: []).__code__)
    monkeypatch.setattr(builtins, "sorted", lambda *a, **k: [])
    assert tamper.replaced(before) == []  # what the learner made of the module's own
    found = check(before)
    monkeypatch.undo()
    assert found == ["builtins.sorted", "zerolab.grading.call.call.__defaults__",
                     "zerolab.grading.kinds.run.__code__",
                     "zerolab.grading.tamper.replaced.__code__", "zerolab.grading.tamper.snapshot"]


def test_a_replaced_function_is_seen_and_a_new_module_is_not(monkeypatch):
    before = tamper.snapshot()
    assert tamper.replaced(before) == []
    import zerolab.grading.compare as compare
    monkeypatch.setattr(compare, "compare_values", lambda *a: None)
    monkeypatch.setattr(torch.Tensor, "__eq__", lambda *a: True, raising=False)
    assert tamper.replaced(before) == ["torch.Tensor.__eq__",
                                       "zerolab.grading.compare.compare_values"]
    monkeypatch.undo()
    import json.tool  # noqa: F401  (a module imported later adds names: not a change)
    assert tamper.replaced(before) == []


def test_answers_built_on_the_reference_are_told(tmp_path):
    """What the learner's process holds, not what its code says: an import statement (text),
    a function renamed from solutions/ or zerolab/, an engine built on zerolab's; the learner's
    own code (even when it lies in solutions/) and a decorated method of its own are not."""
    assert borrowed.imports_solutions("import os\nif x:\n    import solutions.ex02_zero1 as s\n")\
        == "line 3: import solutions.ex02_zero1 as s"
    assert borrowed.imports_solutions("from zerolab import solutions_like\n'import solutions'") \
        is None
    mine = tmp_path / "mine.py"
    mine.write_text("import contextlib\nimport zerolab.zero2\nfrom zerolab import theory\n"
                    "from zerolab.sharding import shard as largest_model\n"
                    "class Own:\n    @contextlib.contextmanager\n    def no_sync(self):\n"
                    "        yield\n"
                    "class Engine(Own, zerolab.zero2.ZeRO2):\n    pass\n")
    before = set(sys.modules)
    module = load_module(mine, prefix="_test_borrowed")
    assert borrowed.in_module(module, module.largest_model, str(mine), "plain", before) == \
        ["your answer is the function shard of zerolab/sharding.py"]
    assert borrowed.in_module(module, module.Own, str(mine), "engine", before) == []
    assert borrowed.in_module(module, module.Engine, str(mine), "engine", before) == \
        ["Engine is built on ZeRO2, zerolab's engine in zerolab/zero2.py"]
    solution = Path(borrowed.SOLUTIONS_DIR) / "ex07_scaling.py"
    graded = load_module(solution, prefix="_test_borrowed")
    assert borrowed.in_module(graded, graded.largest_model, str(solution), "plain", before) == []
    held = module.Own()
    held.inner = [object.__new__(torch.nn.parallel.DistributedDataParallel)]
    assert borrowed.in_engine(held, torch.nn.Linear(1, 1), str(mine)) == [
        "your engine's inner is a DistributedDataParallel, torch's engine in "
        "torch/nn/parallel/distributed.py"]
    with contextlib.suppress(KeyError):
        del sys.modules[module.__name__], sys.modules[graded.__name__]


def test_the_course_is_kept_and_put_back(tmp_path):
    """The other exercise files beside a graded one are the course too: a change is found, put
    back (what was found kept beside it), an added file removed; the graded file is left out."""
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "ex07_scaling.py").write_text("graded")
    (folder / "ex02_collectives.py").write_text("other")
    before = course.snapshot([folder / "ex07_scaling.py"])
    assert course.changes(before) == []
    (folder / "ex07_scaling.py").write_text("graded, changed: the learner's own")
    (folder / "ex02_collectives.py").write_text("rewritten")
    (folder / "ex99_extra.py").write_text("added")
    found = course.changes(before)
    assert [(Path(c.path).name, c.how) for c in found] == [("ex02_collectives.py", "changed"),
                                                           ("ex99_extra.py", "added")]
    assert course.restore(before, found) == []
    assert (folder / "ex02_collectives.py").read_text() == "other"
    assert (folder / f"ex02_collectives.py{course.KEPT}").read_text() == "rewritten"
    assert not (folder / "ex99_extra.py").exists() and course.changes(before) == []
    cache = Path(borrowed.SOLUTIONS_DIR) / "__pycache__" / "ex07_scaling.forged.pyc"
    cache.parent.mkdir(exist_ok=True)
    cache.write_bytes(b"forged")  # not a change to report (Python writes these), but removed
    assert course.changes(before) == []
    course.drop_caches(before)
    assert not cache.exists()


def _call(op: str, nbytes: int, tag: str, dtype: str = "float32") -> dict:
    return {"op": op, "tag": tag, "nbytes": nbytes, "dtype": dtype}


def test_ranks_collectives_compared():
    same = [_call("all_gather", 40, "a"), _call("send", 8, "r"), _call("all_gather", 8, "b")]
    other = [_call("recv", 8, "r"), _call("all_gather", 40, "a"), _call("all_gather", 8, "b")]
    assert flight.first_difference([same, other], finished=True) is None  # p2p aside
    swapped = [_call("all_gather", 8, "b"), _call("all_gather", 40, "a")]
    difference = flight.first_difference([same, swapped], finished=True)
    assert difference.index == 0 and difference.tags_differ
    assert flight.reordered([same, swapped])
    assert "rank 1 all_gather of 8 bytes (float32, tag 'b')" in difference.describe()
    uneven = [_call("all_gather", 40, "a"), _call("all_gather", 4, "b")]
    difference = flight.first_difference([same, uneven], finished=True)
    assert difference.index == 1 and not difference.tags_differ
    # A rank that died early issued fewer: no difference unless the lists are complete.
    assert flight.first_difference([same, same[:1]], finished=False) is None
    assert flight.first_difference([same, same[:1]], finished=True).calls[1] is None
    assert flight.dtypes([[_call("send", 8, "s", "float64")], [_call("recv", 4, "r")]]) == \
        ["float32", "float64"]


def test_a_stopped_run_is_explained():
    timeout = crashes.explain(Stop("timeout", 0, key="k", case=2, label="c", stuck=[0, 1]),
                              30.0, (), [], None)
    assert timeout.timed_out and timeout.message.startswith(
        "timed out after 30 s during case 'c': rank(s) [0, 1] never finished")
    flood = crashes.explain(Stop("output", 0, case="import", output="x\ny"), 30.0, (), [], None)
    assert "printed more than 1 MiB while importing your file" in flood.message
    assert flood.printed == "x\ny"
    exited = crashes.explain(Stop("exited", 1, code=0, case=0, label="c"), 30.0, (), [], None)
    assert "your code ended the process (exit status 0) during case 'c'" in exited.message
    flights = [[_call("all_gather", 40, "ex/a")], [_call("all_gather", 24, "ex/a")]]
    killed = crashes.explain(Stop("killed", 1, code=-6, case=0, label="c"), 30.0, (), flights,
                             None)
    assert "rank 1 was killed by SIGABRT (exit code -6) during case 'c'" in killed.message
    assert "differ at call 1" in killed.message and killed.mistake.kind == \
        "the ranks issued different collectives"
    mixed = [[_call("send", 16, "s", "float64")], [_call("recv", 8, "r", "float32")]]
    assert crashes.explain(Stop("killed", 1, code=-6, case=0), 30.0, (), mixed,
                           None).mistake.kind == "data sent and received in different dtypes"


def test_the_ranks_hash_strings_differently():
    """Rank r's host starts with PYTHONHASHSEED = HASH_SEEDS[r]: three processes that iterate
    6.2's names in three different orders, as processes started one by one do."""
    names = "{'embed.weight', 'norm.weight', 'head.bias', 'gain'}"
    orders = [subprocess.run([sys.executable, "-c", f"print(list({names}))"], text=True,
                             capture_output=True, env={"PYTHONHASHSEED": str(seed)}).stdout
              for seed in HASH_SEEDS]
    assert len(set(orders)) == len(HASH_SEEDS)
    # Every rank of a larger run has a seed of its own too.
    seeds = [hosts.hash_seed(r) for r in range(8)]
    assert seeds[:len(HASH_SEEDS)] == list(HASH_SEEDS) and len(set(seeds)) == 8
