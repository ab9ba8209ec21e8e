"""Notebook 08's exercises (ex08_activations): the bytes a block keeps for backward, and which
blocks to checkpoint to fit a budget."""

from __future__ import annotations

from collections.abc import Callable

from zerolab import theory
from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import fixed
from zerolab.grading.mistakes import Evidence, Mistake, matches

# (batch, seq_len, hidden, heads): tiny, the stub's example, notebook 08's sweep, odd, long
_SHAPES_8_1 = [(1, 1, 8, 1), (2, 16, 32, 2), (1, 32, 64, 4), (4, 256, 64, 4), (2, 128, 64, 4),
               (3, 100, 48, 6), (1, 8192, 4096, 32)]


def _cases_8_1() -> list[Case]:
    return [Case(f"b={b}, s={s}, h={h}, heads={a}, {attention}",
                 fixed(b, s, h, a, attention))
            for attention in theory.ATTENTIONS for b, s, h, a in _SHAPES_8_1]


def _blocks(block: list[int], inputs: list[int], head: int,
            budget: int) -> Callable[[int], tuple]:
    """Fresh lists for each call: a learner's function that sorts them in place changes
    nothing for the solution."""
    return lambda rank: (list(block), list(inputs), head, budget)


def _course_gpt() -> tuple[list[int], list[int], int]:
    """Notebook 08's GPT (4 blocks, h=64, 4 heads, vocabulary 64) at b=2, s=256, fp32."""
    s, b, h, a = 256, 2, 64, 4
    full = int(theory.activation_bytes(s, b, h, a))
    kept = int(theory.activation_bytes(s, b, h, a, checkpoint="block"))
    return [full] * 4, [kept] * 4, int(theory.head_activation_bytes(s, b, h, 64))


def _eight_b() -> tuple[list[int], list[int], int]:
    """The 8B shape (32 blocks, h=4096, 32 heads), one sequence of 16,384 tokens, 16-bit."""
    shape, s = theory.MODEL_SHAPES["8B"], 16384
    args = (s, 1, shape.hidden, shape.num_heads)
    full = int(theory.activation_bytes(*args, bytes_per_element=2))
    kept = int(theory.activation_bytes(*args, checkpoint="block", bytes_per_element=2))
    head = int(theory.head_activation_bytes(s, 1, shape.hidden, shape.vocab_size, 2))
    return [full] * shape.num_layers, [kept] * shape.num_layers, head


def _cases_8_2() -> list[Case]:
    cases = []
    for name, (block, inputs, head) in (("notebook 08's GPT", _course_gpt()),
                                        ("8B shape, s=16384", _eight_b())):
        everything, nothing = head + sum(block), head + sum(inputs)
        for budget in (everything, everything - 1, (everything + nothing) // 2, nothing,
                       nothing - 1):
            cases.append(Case(f"{name}, budget {budget:,}", _blocks(block, inputs, head, budget)))
    unequal = ([100, 300, 200, 300], [10, 10, 10, 60], 50)  # savings 90, 290, 190, 240
    for budget in (950, 949, 700, 660, 659, 420, 230, 140, 139):
        cases.append(Case(f"unequal blocks, budget {budget}", _blocks(*unequal, budget)))
    ties = ([50, 80, 50, 80, 50], [10, 40, 10, 40, 10], 0)  # savings 40 at every index
    for budget in (310, 270, 230, 150, 109):
        cases.append(Case(f"equal savings, budget {budget}", _blocks(*ties, budget)))
    cases += [Case("no blocks, the head fits", _blocks([], [], 10, 10)),
              Case("no blocks, the head does not fit", _blocks([], [], 10, 9)),
              Case("the stub's example", _blocks([100, 300, 200], [10, 10, 10], 50, 400))]
    return cases


# ---- what the grader can tell apart ------------------------------------------------------------


def _saved(ev: Evidence, *, stats: bool = True, elements: bool = False, mask: bool = True,
           output: bool = False, attention: str | None = None) -> int:
    """8.1's count with one thing changed: the LayerNorm statistics left out, elements counted
    instead of bytes, explicit attention's mask left out, the block's output counted, or the
    other attention's formula."""
    b, s, h, a, kind = ev.inputs()
    kind = attention or kind
    size = 1 if elements else 4
    tokens = b * s
    total = tokens * (16 * h * size + (4 * size if stats else 0) + (h * size if output else 0))
    if kind == "sdpa":
        return total + size * a * tokens
    return total + size * a * s * s * b + (s * s if mask else 0)


def _other(kind: str) -> str:
    return "explicit" if kind == "sdpa" else "sdpa"


def _choose(ev: Evidence, *, by_index: bool = False, high_first: bool = False,
            strict: bool = False, empty_for_none: bool = False) -> list[int] | None:
    """8.2's choice made another way: blocks in index order, ties to the higher index, the
    budget as a strict bound, or [] where nothing fits."""
    block, inputs, head, budget = ev.inputs()
    kept = head + sum(block)

    def fits(k: int) -> bool:
        return k < budget if strict else k <= budget
    if by_index:
        order = list(range(len(block)))
    else:
        order = sorted(range(len(block)), key=lambda i: (inputs[i] - block[i],
                                                         -i if high_first else i))
    chosen: list[int] = []
    for i in order:
        if fits(kept):
            break
        chosen.append(i)
        kept -= block[i] - inputs[i]
    if fits(kept):
        return sorted(chosen)
    return [] if empty_for_none else None


EXERCISES = [
    Exercise("8.1", "ex08_activations", "bytes_saved",
             "the activation bytes one transformer block keeps for backward, from its code",
             "Count per token: the two LayerNorms' inputs and outputs, q, k, v, the attention "
             "output and the MLP's 4h input and output of the GELU are 16h fp32 elements; add "
             "the LayerNorm statistics, then the attention core's own: a logsumexp per head for "
             "sdpa, the (b, a, s, s) probabilities and the (s, s) mask for explicit.",
             _cases_8_1,
             hints=("Per token and block: LayerNorm 1 saves its input (h) and output (h) and "
                    "2 statistics, so does LayerNorm 2; q, k, v (3h); the attention's output "
                    "(h); the MLP's first Linear output and the GELU's output (4h each). Times "
                    "4 bytes; then the attention core's own.",),
             mistakes=(
                 Mistake("the LayerNorms' mean and rstd left out",
                         "Each LayerNorm saves its mean and its reciprocal standard deviation "
                         "(one float each per token) for backward, besides its input.",
                         matches(lambda ev: _saved(ev, stats=False))),
                 Mistake("elements, not bytes",
                         "fp32: 4 bytes per element (the causal mask: 1 byte per element).",
                         matches(lambda ev: _saved(ev, elements=True))),
                 Mistake("explicit attention's causal mask left out",
                         "The explicit attention saves its (s, s) boolean causal mask too: one "
                         "byte per element.", matches(lambda ev: _saved(ev, mask=False))),
                 Mistake("the other attention's formula",
                         "sdpa (fused) keeps a logsumexp per head and token; explicit attention "
                         "keeps the (b, a, s, s) softmax probabilities and the (s, s) mask.",
                         matches(lambda ev: _saved(ev, attention=_other(ev.inputs()[4])))),
                 Mistake("the block's output counted",
                         "The block's output is the next block's input: that block (its first "
                         "LayerNorm) saves it, not this one.",
                         matches(lambda ev: _saved(ev, output=True))))),
    Exercise("8.2", "ex08_activations", "blocks_to_checkpoint",
             "which blocks to checkpoint so that the activations fit in a memory budget",
             "Checkpoint the blocks that save the most first (block_bytes[i] - input_bytes[i]), "
             "the lower index first among equal savings, and stop as soon as it fits; return "
             "[] if it fits already and None if it never does.",
             _cases_8_2,
             hints=("Sort the blocks by saving, largest first (the lower index first among "
                    "equal savings), and take them one by one until head_bytes + the blocks' "
                    "bytes fit in the budget; [] if it fits already, None if it never does.",),
             mistakes=(
                 Mistake("blocks checkpointed in index order",
                         "Checkpoint the blocks that save the most first: in index order you "
                         "may checkpoint more blocks than needed.",
                         matches(lambda ev: _choose(ev, by_index=True))),
                 Mistake("equal savings: the higher index chosen first",
                         "Among equal savings take the lower index first (the smallest list).",
                         matches(lambda ev: _choose(ev, high_first=True))),
                 Mistake("the budget taken as a strict bound",
                         "Fitting means at most the budget: kept <= budget.",
                         matches(lambda ev: _choose(ev, strict=True))),
                 Mistake("[] where nothing fits",
                         "Return None when even checkpointing every block does not fit ([] "
                         "means: it fits without checkpointing anything).",
                         matches(lambda ev: _choose(ev, empty_for_none=True))))),
]
