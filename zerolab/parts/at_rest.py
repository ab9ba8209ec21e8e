"""ZeRO-3's parameters between steps, and a write to them that would be lost.

Between steps a ZeRO-3 parameter is a 0-element tensor: its values live in this rank's flat
shard (zero3.py, reshard). A torch user who initialises the model after wrapping it
(`p.normal_()`, `nn.init.*_(p)`, `p.copy_(...)`) writes into nothing, and no error says so;
FSDP2's parameters between steps are DTensors of dim-0 rows that take such a write. zerolab's
shards are flat ranges through several parameters, not rows, so the write cannot be taken: it
is refused at the unit's next unshard (its next forward, or a state dict), before any step
trains on weights the user did not mean. torch counts every in-place write to a tensor in its
version counter (`Tensor._version`, what autograd checks its saved tensors against); a
`p.data = ...` by hand shows as a parameter that is no longer 0-element.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


class AtRest:
    """Each freed parameter's version counter when it was freed."""

    def __init__(self) -> None:
        self.versions: dict[int, int] = {}  # id(parameter) -> its version when freed

    def freed(self, params: Iterable[nn.Parameter]) -> None:
        for p in params:
            self.versions[id(p)] = p._version

    def check(self, params: Iterable[nn.Parameter], engine: str) -> None:
        """Before a unit's parameters point into its gathered buffer again."""
        for p in params:
            if id(p) in self.versions and (p._version != self.versions[id(p)] or p.numel() > 0):
                raise RuntimeError(WRITTEN_AT_REST.format(engine))


WRITTEN_AT_REST = (
    "{0}: a parameter of the wrapped model was written in place between steps (p.normal_(), "
    "nn.init.*_(p), p.copy_(...) or p.data = ... after wrapping). Under ZeRO-3 a parameter "
    "holds no values between steps (this rank's shard does), so the write would be lost. "
    "Initialise the model before wrapping it, or load full weights after: "
    "engine.module.load_state_dict(full_state_dict) (a collective: every rank calls it).")
