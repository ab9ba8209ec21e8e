"""Exercises for notebook 08: the activation memory ZeRO does not shard, and checkpointing.

Check your answers with `grade("ex08")` in the notebook, or `python -m zerolab.grade ex08`.
"""

# Write your code in place of each `raise NotImplementedError(...)`. This file is generated
# from solutions/ by `python -m zerolab.grade --make-exercises`; the imports are the ones the
# solution uses, kept for you.
# ruff: noqa: F401

from __future__ import annotations


def bytes_saved(batch: int, seq_len: int, hidden: int, heads: int, attention: str) -> int:
    """Exercise 8.1: The bytes one block of the course GPT keeps for backward.

    Inputs: batch: b sequences; seq_len: s tokens each; hidden: h, the block's width (n_embd);
    heads: a, the attention heads (n_head, which divides h); attention: "sdpa" (fused) or
    "explicit" (softmax(QK^T)V written out), as GPTConfig.attention.
    Returns: an int: the bytes that one `Block` of zerolab.models, in fp32 and without
    checkpointing, holds for backward once its forward is done, counted as
    zerolab.activations measures them: every storage autograd saved during the block's
    forward, each once (views of one storage count once), parameters left out. The block's
    input counts (its first LayerNorm saves it); its output does not (the next block's does).
    Example: b=2, s=16, h=32, a=2: "sdpa" 66,304 bytes, "explicit" 70,400 bytes.
    Graded on: both attentions at a tiny shape, the example's, notebook 08's sweep shapes, an
    odd shape (b=3, s=100, h=48, a=6) and a long one (s=8192, h=4096, a=32). Compared
    exactly.

    Hint: read Block.forward op by op and ask what each op's backward needs; section 1 of the
    notebook lists what autograd saved for one shape, with the op that saved it.
    """
    f, tokens = 4, batch * seq_len
    layer_norms = 2 * (2 * hidden * f + 2 * f) * tokens  # input, output, mean, rstd: twice
    qkv = 3 * hidden * f * tokens
    attention_output = hidden * f * tokens
    mlp = 2 * 4 * hidden * f * tokens  # the GELU's input and output
    if attention == "sdpa":
        core = heads * tokens * f
    else:
        core = heads * seq_len * seq_len * batch * f + seq_len * seq_len
    return layer_norms + qkv + attention_output + mlp + core


def blocks_to_checkpoint(block_bytes: list[int], input_bytes: list[int], head_bytes: int,
                         budget: int) -> list[int] | None:
    """Exercise 8.2: Which blocks to checkpoint so that the activations fit in a budget.

    Inputs: block_bytes[i]: what block i keeps for backward without checkpointing;
    input_bytes[i]: what it keeps when it is checkpointed (its input only; never more than
    block_bytes[i]); head_bytes: what the rest of the model keeps; budget: the bytes the
    activations may take at the end of forward.
    Returns: the sorted indices of the blocks to checkpoint, or None if even checkpointing
    every block does not fit. At the end of forward the model keeps head_bytes plus, for each
    block, input_bytes[i] if it is checkpointed and block_bytes[i] if not; that must be
    <= budget. Each checkpointed block runs its forward again in backward, so checkpoint as
    few blocks as possible; among equally few, keep the fewest bytes; among those, return the
    smallest list (Python's list order: [0, 3] < [1, 2]).
    Example: block_bytes [100, 300, 200], input_bytes [10, 10, 10], head_bytes 50, budget 400
    -> [1]: 50 + 100 + 10 + 200 = 360 bytes.
    Graded on: the notebook's GPT (four equal blocks) and an 8B-shaped model at budgets from
    everything-fits to nothing-fits, unequal blocks, equal savings at different indices, and
    no blocks at all. Compared exactly.

    Hint: checkpointing block i saves block_bytes[i] - input_bytes[i]. With k blocks
    checkpointed, which k save the most?
    """
    need = head_bytes + sum(block_bytes) - budget
    if need <= 0:
        return []
    savings = sorted(((block_bytes[i] - input_bytes[i], -i) for i in range(len(block_bytes))),
                     reverse=True)
    chosen = []
    for saving, minus_i in savings:
        chosen.append(-minus_i)
        need -= saving
        if need <= 0:
            return sorted(chosen)
    return None
