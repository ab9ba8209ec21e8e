"""Global-norm gradient clipping when each rank holds only part of the gradient.

torch.nn.utils.clip_grad_norm_ computes the L2 norm of *all* the gradients. In DDP every rank
holds all of them, already averaged, so it can do the same. In ZeRO each rank holds a shard:
its sum of squares is a part of the total, so the ranks add their parts up (one scalar
all-reduce), take the square root, and each scales its own shard by the same factor.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def clip_grad_norm_(grads: list[torch.Tensor], max_norm: float,
                    sum_over_ranks: Callable[[torch.Tensor], torch.Tensor]) -> float:
    """Scale `grads` in place so that the global L2 norm is at most max_norm.

    grads: the gradients this rank owns. sum_over_ranks: () -> () the sum of a scalar over
    the ranks that own the other parts (the identity when every rank owns everything).
    Returns the global norm before clipping, as torch.nn.utils.clip_grad_norm_ does.
    """
    local_sq = sum((g.float().pow(2).sum() for g in grads),
                   torch.zeros((), device=grads[0].device))
    norm = sum_over_ranks(local_sq).sqrt()
    clip = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # the formula torch uses
    for g in grads:
        g.mul_(clip.to(g.dtype))
    return norm.item()
