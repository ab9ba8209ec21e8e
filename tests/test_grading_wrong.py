"""The function exercises' wrong answers (tests/grading_wrong/, one diff each), graded at once.

Every one must be graded wrong, on the world size where it shows, naming the output that
differed (or how the process stopped) and the kind of mistake; every exercise has at least three
wrong answers whose kinds the grader names, of different kinds. The misdiagnoses found by a
learner are checked by their message: a float32 buffer is a dtype lost, not a shard missing
(2.2); a view into a bigger buffer is called so, not "its own" (3.1).
"""

from pathlib import Path

import pytest
from patches import answers

from zerolab import grading

TESTS = Path(__file__).resolve().parent
TIMEOUT = 240.0  # seconds per case: a loaded machine is slow, not wrong

# answer -> (world size it shows on, None for a plain exercise; the output named, or how the
# process ended: "raised <Error>", "killed by <SIGNAL>"; the kind of mistake, "" for the
# exercise's general hint)
CAUGHT = {
    "1.1-fp32-always": (None, 'result', 'the bytes per parameter ignored'),
    "1.1-integer-division": (None, 'result', 'whole bytes: integer division'),
    "1.1-next-stage": (None, 'result',
                       'one category sharded too many: the numbers of the next stage'),
    "1.1-previous-stage": (None, 'result',
                           'one category sharded too few: the numbers of the previous stage'),
    "1.2-contiguous-copy": (None, 'result', 'a non-contiguous view copied before counting'),
    "1.2-elements-not-storage": (None, 'result',
                                 'the elements a tensor shows counted, not its whole storage'),
    "1.2-view-start": (None, 'result', "a view's start taken for its storage"),
    "1.2-views-counted-again": (None, 'result', 'views and tied weights counted again'),
    "2.1-all-reduce": (1, 'comm ops', 'a library collective instead of the ring'),
    "2.1-float32-buffer": (2, 'killed by SIGABRT', 'data sent and received in different dtypes'),
    "2.1-input-changed": (1, 'memory', 'the chunk: a view of an input, not a copy'),
    "2.1-off-by-one": (2, 'result', "a partial sum: some ranks' contributions missing"),
    "2.1-overwrites": (2, 'result', "a partial sum: some ranks' contributions missing"),
    "2.1-working-copy-view": (2, 'memory', 'the chunk: a view into a bigger buffer'),
    "2.2-float32-buffer": (1, 'result', 'the dtype lost'),
    "2.2-library-collective": (1, 'comm ops', 'a library collective instead of the ring'),
    "2.2-own-shard-missing": (1, 'result', 'your own shard missing from its place'),
    "2.2-shard-itself": (1, 'memory', 'the gathered tensor: a view of an input, not a copy'),
    "2.2-wrong-way": (3, 'result', ''),
    "2.3-input-itself": (1, 'memory', 'the input itself returned'),
    "2.3-more-padding": (2, 'bytes sent', 'more padding than needed'),
    "2.3-padding-kept": (2, 'raised RuntimeError', 'the padding not stripped'),
    "2.3-stripped-at-front": (2, 'result', 'the padding stripped at the wrong end'),
    "2.3-sum": (2, 'result', 'a sum, not the mean (N times too big)'),
    "2.3-view-not-reshape": (1, 'raised RuntimeError', '.view() of a non-contiguous tensor'),
    "3.1-float32": (None, 'result', 'the dtype lost'),
    "3.1-floor": (None, 'result', 'shard size from floor instead of ceil'),
    "3.1-neighbour": (None, 'result', "off by one shard: a neighbour's shard"),
    "3.1-padding-in-front": (None, 'result', 'the padding at the wrong end'),
    "3.1-view-of-padded": (None, 'memory', 'the shard: a view into a bigger buffer'),
    "3.2-float32": (None, 'result', 'the dtype lost'),
    "3.2-not-in-shape": (None, 'result', 'a tensor not in its shape'),
    "3.2-offset-stays": (None, 'result', 'every tensor starting at element 0'),
    "3.2-padding-in-front": (None, 'result', 'the padding taken to be at the front'),
    "3.3-all-reduce": (1, 'comm ops', 'an all-reduce where a reduce-scatter belongs'),
    "3.3-float32": (2, 'killed by SIGABRT', 'a float32 buffer for float64 data'),
    "3.3-momentum-in-place": (1, 'input momentum', 'the momentum changed in place'),
    "3.3-sum": (2, 'params', 'gradients summed over the ranks, not averaged'),
    "4.1-all-reduce": (1, 'comm ops', 'an all-reduce where a reduce-scatter belongs'),
    "4.1-not-freed": (1, 'freed .grad', 'the full gradients not freed'),
    "4.1-overwrites": (1, 'grad_shard', 'the earlier micro-batches overwritten'),
    "4.1-rebound": (1, 'grad_shard', 'grad_shard rebound, not changed in place'),
    "4.1-sum": (2, 'grad_shard', 'gradients summed over the ranks, not averaged'),
    "5.1-copies": (1, 'storages (bytes each)', 'copies, not views of one buffer'),
    "5.1-local-shard-views": (1, 'memory', 'views of local_shard itself'),
    "5.1-no-all-gather": (1, 'comm ops', 'no all-gather'),
    "5.1-padding-in-front": (2, 'result', 'the padding taken to be at the front'),
    "5.2-del": (None, 'bytes still held', 'nothing freed'),
    "5.2-dtype": (None, "params' dtype", "the parameters' dtype changed"),
    "5.2-flat-replaced": (None, 'bytes still held',
                          'flat_param given a new tensor; its old storage lives on'),
    "5.2-params-point-into-freed": (None, "params' numel",
                                    'the parameters still point into the freed storage'),
    "6.1-array-split": (None, 'result', "numpy.array_split's rule, not torch.chunk's"),
    "6.1-float32": (None, 'result', 'the dtype lost'),
    "6.1-padded": (None, 'result', 'the last shards padded'),
    "6.1-view": (None, 'memory', 'the rows: a view of an input, not a copy'),
    "6.2-all-reduce": (1, 'comm ops', 'an all-reduce where an all-gather belongs'),
    "6.2-padding-in-front": (2, 'result', "the padding rows put before the shard's rows"),
    "6.2-padding-kept": (2, 'result', 'the padding rows kept'),
    "6.2-views-of-padded": (2, 'in a bigger buffer',
                            'the full tensors: views into the padded buffer'),
    "6.2-set-order": (2, 'killed by SIGABRT',
                      'the ranks issued their collectives in different orders'),
    "6.2-shards-themselves": (1, "in a shard's memory", 'the shards themselves returned'),
    "6.2-uneven": (2, 'killed by SIGABRT', 'an uneven all-gather'),
    "7.1-another-stage": (None, 'result', "another stage's sharding"),
    "7.1-float-division": (None, 'result', 'a float quotient: one parameter off'),
    "7.1-float-floor-division": (None, 'result', 'a float quotient: one parameter off'),
    "7.1-no-master-weights": (None, 'result', 'mixed precision without the fp32 master weights'),
    "7.1-rounded-up": (None, 'result', 'rounded up or to the nearest, not down'),
    "7.1-rounded": (None, 'result', 'rounded up or to the nearest, not down'),
    "7.2-all-reduce-steps": (None, 'result', 'an all-reduce counted as N - 1 steps'),
    "7.2-latency-once": (None, 'result', 'the latency paid once, not per step'),
    "7.2-whole-message": (None, 'result', 'a step sends S, not S/N'),
    "8.1-elements": (None, 'result', 'elements, not bytes'),
    "8.1-no-mask": (None, 'result', "explicit attention's causal mask left out"),
    "8.1-no-statistics": (None, 'result', "the LayerNorms' mean and rstd left out"),
    "8.1-output-counted": (None, 'result', "the block's output counted"),
    "8.1-sdpa-as-explicit": (None, 'result', "the other attention's formula"),
    "8.2-empty-for-none": (None, 'result', '[] where nothing fits'),
    "8.2-high-index-first": (None, 'result', 'equal savings: the higher index chosen first'),
    "8.2-index-order": (None, 'result', 'blocks checkpointed in index order'),
    "8.2-strict": (None, 'result', 'the budget taken as a strict bound'),
    "9.1-elements": (None, 'result', 'elements, not bytes'),
    "9.1-inside-node-counted": (None, 'result', 'a collective inside one node counted'),
    "9.1-not-ring": (None, 'result', 'the whole tensor sent, not (n-1)/n of it'),
    "9.1-whole-gradient": (None, 'result', "HSDP's all-reduce of the whole gradient"),
    "9.2-divide-by-128": (None, 'values', 'scale = max / 128'),
    "9.2-one-scale": (None, 'values', 'one scale for the whole tensor'),
    "9.2-truncated": (None, 'values', 'truncated, not rounded'),
    "9.3-divided": (None, 'result', 'divided by the scale'),
    "9.3-int8": (None, 'result', 'the dtype lost'),
    "9.3-not-cut": (None, 'raised RuntimeError', 'the scales repeated past the last element'),
    "9.3-tiled": (None, 'result', 'the scales tiled, not repeated element by element'),
    "11.1-everyone-gathers": (3, 'bytes sent', 'every rank gathers the whole gradient'),
    "11.1-shard-alone": (1, 'result', 'each shard orthogonalised alone, never gathered'),
    "11.1-transposed": (1, 'result', 'the gradient read as (cols, rows): a transpose'),
    "11.1-whole-update": (2, 'bytes sent', 'the whole update sent back to every rank'),
    "12.1-all-gather": (1, 'comm ops', 'an all-gather where an all-reduce belongs'),
    "12.1-bias-before-sum": (2, 'result', 'out_bias added on every rank before the sum'),
    "12.1-no-all-reduce": (1, 'comm ops', "no all-reduce: one rank's partial sum"),
    "12.1-row-then-column": (2, 'result', 'row-parallel first: GELU of a partial sum'),
    "12.1-sum-before-gelu": (2, 'result', "the all-reduce before GELU, on fc's outputs"),
}


@pytest.fixture(scope="module")
def graded(tmp_path_factory) -> dict[str, grading.Result]:
    """Every wrong answer, graded in one call: one run per world size for all of them."""
    made = answers(TESTS / "grading_wrong", tmp_path_factory.mktemp("wrong"),
                   TESTS.parent / "solutions")
    names = sorted(made)
    results = grading.grade_files([(n.split("-")[0], made[n]) for n in names], timeout=TIMEOUT)
    return dict(zip(names, results))


def test_every_answer_on_disk_is_listed():
    on_disk = {p.stem for p in (TESTS / "grading_wrong").glob("*.diff")}
    assert on_disk == set(CAUGHT)
    for path in (TESTS / "grading_wrong").glob("*.diff"):
        assert "# BUG" in path.read_text(), path.name


def test_three_named_kinds_per_exercise():
    functions = [i for i, ex in grading.EXERCISES.items() if ex.kind != "engine"]
    for ex_id in functions:
        kinds = {m for n, (_, _, m) in CAUGHT.items() if n.split("-")[0] == ex_id and m}
        assert len(kinds) >= 3, (ex_id, kinds)


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_wrong_answer_is_caught(graded, name):
    result = graded[name]
    world_size, output, mistake = CAUGHT[name]
    assert result.status == "wrong" and not result.timed_out, str(result)
    assert result.world_size == world_size, str(result)
    if output.startswith("raised"):
        assert result.message.startswith(output), str(result)
        assert f"/{name}/" in result.traceback, str(result)  # the learner's own line
    elif output.startswith("killed"):
        assert output in result.message and "Likely cause" in result.message, str(result)
    else:
        assert result.output == output, str(result)
    assert result.mistake == mistake, str(result)
    known = {m.kind: m.hint for m in result.exercise.mistakes}
    if mistake in known:
        assert result.hint == known[mistake]
    if not mistake:
        assert result.hint == result.exercise.hint
    assert "zerolab/grading" not in str(result)  # the grader's internals are not shown


def test_misdiagnoses_are_fixed(graded):
    """A float32 buffer on float64 data is a dtype lost, not "your own shard missing"; a view
    into a bigger buffer is called so, not "its own"."""
    buffer = graded["2.2-float32-buffer"]
    assert "expected dtype torch.float64, got torch.float32" in buffer.message, str(buffer)
    view = graded["3.1-view-of-padded"]
    assert "got 'a view into a buffer of" in view.message and "its own" not in \
        view.message.split("got")[1], str(view)
    ordered = graded["6.2-set-order"]
    assert "collectives differ at call 1" in ordered.message and "tag 'ex6.2/" in \
        ordered.message, str(ordered)
    mixed = graded["2.1-float32-buffer"]
    assert "float32" in mixed.message and "float64" in mixed.message, str(mixed)


def test_report_reads_well(graded):
    text = "\n".join(str(graded[n]) for n in ("2.3-sum", "2.1-off-by-one"))
    assert "2.3  ex02_collectives.all_reduce_mean       WRONG" in text
    assert "on 2 ranks, rank 0, case 'shape (1,)'" in text
    assert "looks like: a sum, not the mean (N times too big)" in text
    assert 'more hints: hint("2.3")' in text
    assert all(len(line) <= 104 for line in text.splitlines() if "case '" not in line)
