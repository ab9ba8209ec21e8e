"""The optimizer steps cache-sized tiles of its masters (zerolab/parts/tiles.py): the same result as
whole tensors, bitwise; its state joins back per master and loads again; engines cut on a CPU."""

import pytest
import torch
from torch import nn
from workers import features as F

import zerolab
from zerolab.parts.tiles import CPU_TILE_NUMEL, OptimizerTiles

SHAPES = [(3, 5), (7,), (1,), (4, 4, 2)]  # 15, 7, 1, 32 elements: some cut, some not at 6


def masters(seed: int) -> list[nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(s, generator=gen)) for s in SHAPES]


def set_grads(ps: list[nn.Parameter], step: int) -> None:
    gen = torch.Generator().manual_seed(100 + step)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)  # a new tensor every step, as ZeRO-1 does


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 0.1, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


class WholeAndTiled:
    """The same masters twice, one optimizer on them whole, one on tiles of 6 elements."""

    def __init__(self, name: str):
        cls, kwargs = OPTIMIZERS[name]
        self.whole, self.tiled = masters(0), masters(0)
        self.tiles = OptimizerTiles(self.tiled, 6)
        self.opt_whole, self.opt_tiled = cls(self.whole, **kwargs), cls(self.tiles.params(),
                                                                          **kwargs)
        self.tiles.attach(self.opt_tiled)

    def step(self, step: int) -> None:
        set_grads(self.whole, step)
        set_grads(self.tiled, step)
        self.opt_whole.step()
        self.opt_tiled.step()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_tiles_step_bitwise_like_whole_tensors(name):
    run = WholeAndTiled(name)
    assert len(run.tiles.params()) == 3 + 2 + 1 + 6  # ceil(numel / 6) each
    for step in range(3):
        run.step(step)
        for a, b in zip(run.whole, run.tiled):
            assert torch.equal(a, b), (name, step)
        # a tile's gradient is a view of its master's: dropped after the step, so that a freed
        # master gradient is not kept alive by it
        assert all(t.grad is None for t in run.tiles.params()
                   if all(t is not m for m in run.tiled))


def test_a_master_no_larger_than_a_tile_is_given_as_it_is():
    ps = masters(0)
    tiles = OptimizerTiles(ps, 15)
    given = tiles.params()
    assert given[0] is ps[0] and given[1] is ps[1] and given[2] is ps[2]  # 15, 7, 1 elements
    assert len(given) == 3 + 3  # the 32-element master in tiles of 15, 15, 2
    assert all(t is m for t, m in zip(OptimizerTiles(ps, None).params(), ps))
    assert not OptimizerTiles(ps, 32).cut


def test_tiles_are_views_of_the_master():
    (p,) = [nn.Parameter(torch.zeros(10))]
    tiles = OptimizerTiles([p], 4)
    with torch.no_grad():
        for i, t in enumerate(tiles.params()):
            t.fill_(i + 1)
    assert p.tolist() == [1.0] * 4 + [2.0] * 4 + [3.0] * 2


def test_state_joins_per_master_and_loads_back():
    cls, kwargs = OPTIMIZERS["adamw"]
    run = WholeAndTiled("adamw")
    for step in range(2):
        run.step(step)
    whole, tiled, tiles, opt_whole, opt_tiled = (run.whole, run.tiled, run.tiles, run.opt_whole,
                                                 run.opt_tiled)
    joined = [tiles.state(opt_tiled, m) for m in tiled]
    for state, expected, m in zip(joined, (opt_whole.state[p] for p in whole), tiled):
        assert sorted(state) == sorted(expected)
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == m.shape and torch.equal(state[key], expected[key])
        assert float(state["step"]) == float(expected["step"]) == 2
    assert tiles.state(opt_tiled, torch.zeros(3)) == {}  # not stepped here (a frozen one)

    # Load the joined state into a fresh optimizer with other tiles, then take a step in both.
    again = [nn.Parameter(m.detach().clone()) for m in tiled]
    other = OptimizerTiles(again, 4)
    opt_again = cls(other.params(), **kwargs)
    other.attach(opt_again)
    for m, state in zip(again, joined):
        other.load_state(opt_again, m, state)
    set_grads(whole, 2)
    set_grads(again, 2)
    opt_whole.step()
    opt_again.step()
    for a, b in zip(whole, again):
        assert torch.equal(a, b)
    steps = [opt_again.state[t]["step"] for t in other.params()]
    assert len({id(s) for s in steps}) == len(steps)  # each tile advances its own count
    with pytest.raises(KeyError, match="not one the optimizer steps"):
        other.load_state(opt_again, torch.zeros(3), joined[0])


@pytest.mark.parametrize("bad", [0, -4])
def test_a_tile_must_hold_an_element(bad):
    with pytest.raises(ValueError, match="tile_numel must be a positive number of elements"):
        OptimizerTiles(masters(0), bad)


def test_engines_on_a_cpu_cut_large_masters_and_train_bitwise_as_whole_ones():
    """DDP and ZeRO-1, 2, 3 at 2 ranks, in fp32 and bf16: tiles of 5 elements against whole
    masters, 3 steps."""
    results = zerolab.launch(F.tiled_against_whole, 2, args=(["ddp", "zero1", "zero2", "zero3"],))
    for r in results:
        assert r["default_tile_numel"] == CPU_TILE_NUMEL
        assert len(r["runs"]) == 4 * 2
        for engine_key, (tiled, whole, cut, n_whole) in r["runs"].items():
            assert cut > n_whole, engine_key  # the masters really were cut
            assert all(torch.equal(tiled[k], whole[k]) for k in whole), engine_key
