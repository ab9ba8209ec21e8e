"""Notebook 08's exercises (ex08_activations): the bytes a block keeps for backward, and which
blocks to checkpoint to fit a budget."""

from __future__ import annotations

from collections.abc import Callable

from zerolab import theory
from zerolab.grading.exercise import Case, Exercise
from zerolab.grading.inputs import _fixed

# (batch, seq_len, hidden, heads): tiny, the stub's example, notebook 08's sweep, odd, long
_SHAPES_8_1 = [(1, 1, 8, 1), (2, 16, 32, 2), (1, 32, 64, 4), (4, 256, 64, 4), (2, 128, 64, 4),
               (3, 100, 48, 6), (1, 8192, 4096, 32)]


def _cases_8_1() -> list[Case]:
    return [Case(f"b={b}, s={s}, h={h}, heads={a}, {attention}",
                 _fixed(b, s, h, a, attention))
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


EXERCISES = [
    Exercise("8.1", "ex08_activations", "bytes_saved",
             "the activation bytes one transformer block keeps for backward, from its code",
             "Count per token: the two LayerNorms' inputs and outputs, q, k, v, the attention "
             "output and the MLP's 4h input and output of the GELU are 16h fp32 elements; add "
             "the LayerNorm statistics, then the attention core's own: a logsumexp per head for "
             "sdpa, the (b, a, s, s) probabilities and the (s, s) mask for explicit.",
             _cases_8_1),
    Exercise("8.2", "ex08_activations", "blocks_to_checkpoint",
             "which blocks to checkpoint so that the activations fit in a memory budget",
             "Checkpoint the blocks that save the most first (block_bytes[i] - input_bytes[i]), "
             "the lower index first among equal savings, and stop as soon as it fits; return "
             "[] if it fits already and None if it never does.",
             _cases_8_2),
]
