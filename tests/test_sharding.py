"""zerolab.sharding: flat padded buffers and their shards, for uneven sizes and N = 1..4."""

import pytest
import torch

from zerolab.sharding import FlatLayout, flatten, shard, unflatten

# Shapes of the tensors laid end to end; their total numel is in the id.
CASES = {
    "doc_example_10": [(2, 3), (3,), (1,)],  # the module docstring's example
    "one_element_1": [(1,)],  # numel < N for N >= 2: some shards are pure padding
    "uneven_11": [(2, 3), (5,)],
    "even_12": [(4, 3)],
    "many_small_7": [(1,), (2,), (1,), (3,)],
    "with_empty_5": [(2, 2), (0,), (1,)],  # a zero-size tensor between two others
}
WORLD_SIZES = (1, 2, 3, 4)


def make(shapes, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(s, generator=gen) * 10).to(dtype) for s in shapes]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shapes", CASES.values(), ids=CASES.keys())
def test_layout(shapes, world_size):
    tensors = make(shapes)
    layout = FlatLayout.of(tensors, world_size)
    numel = sum(t.numel() for t in tensors)
    assert layout.numel == numel
    assert layout.padded_numel % world_size == 0
    assert numel <= layout.padded_numel < numel + world_size  # the least padding that works
    assert layout.shard_numel * world_size == layout.padded_numel
    ranges = [layout.shard_range(r) for r in range(world_size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == layout.padded_numel
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    assert layout.shapes == tuple(t.shape for t in tensors)


def test_doc_example_by_hand():
    layout = FlatLayout.of(make([(2, 3), (3,), (1,)]), 4)
    assert layout.offsets == (0, 6, 9)
    assert (layout.numel, layout.padded_numel, layout.shard_numel) == (10, 12, 3)
    assert [layout.shard_range(r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]
    one = FlatLayout.of([torch.ones(1)], 3)
    assert (one.numel, one.padded_numel, one.shard_numel) == (1, 3, 1)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("shapes", CASES.values(), ids=CASES.keys())
def test_flatten_shard_gather_unflatten_round_trip(shapes, world_size):
    tensors = make(shapes)
    layout = FlatLayout.of(tensors, world_size)
    flat = flatten(tensors, layout)
    assert flat.shape == (layout.padded_numel,) and flat.dtype == torch.float32
    assert not flat[layout.numel:].any()  # padding is zeros
    shards = [shard(flat, layout, r) for r in range(world_size)]
    assert all(s.shape == (layout.shard_numel,) for s in shards)
    # An all-gather puts the shards back in rank order: the same flat buffer.
    gathered = torch.cat(shards)
    assert torch.equal(gathered, flat)
    back = unflatten(gathered, layout)
    assert len(back) == len(tensors)
    for t, b in zip(tensors, back):
        assert b.shape == t.shape
        assert torch.equal(b, t)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shards_and_unflattened_tensors_are_views(world_size):
    tensors = make(CASES["uneven_11"])
    layout = FlatLayout.of(tensors, world_size)
    flat = flatten(tensors, layout)
    ptr = flat.untyped_storage().data_ptr()
    views = unflatten(flat, layout)
    mine = shard(flat, layout, world_size - 1)
    assert all(v.untyped_storage().data_ptr() == ptr for v in views)
    assert mine.untyped_storage().data_ptr() == ptr
    views[1][-1] = 123.0  # the last real element, index 10
    assert flat[10].item() == 123.0
    start, _ = layout.shard_range(world_size - 1)
    assert mine[10 - start].item() == 123.0  # 11 elements: index 10 is in the last shard


@pytest.mark.parametrize("world_size", (2, 3, 4))
def test_numel_smaller_than_world_size_leaves_padding_only_shards(world_size):
    tensors = [torch.tensor([7.0])]
    layout = FlatLayout.of(tensors, world_size)
    flat = flatten(tensors, layout)
    assert shard(flat, layout, 0).tolist() == [7.0]
    for r in range(1, world_size):
        assert shard(flat, layout, r).tolist() == [0.0]


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.int64])
def test_dtype_is_kept(dtype):
    tensors = make([(3,), (2, 2)], dtype)
    layout = FlatLayout.of(tensors, 3)
    flat = flatten(tensors, layout)
    assert flat.dtype == dtype
    assert all(torch.equal(a, b) for a, b in zip(tensors, unflatten(flat, layout)))


def test_non_contiguous_input_is_copied_by_value():
    t = torch.arange(6.0).view(2, 3).t()  # (3, 2), not contiguous
    layout = FlatLayout.of([t], 4)
    flat = flatten([t], layout)
    assert flat[:6].tolist() == t.reshape(-1).tolist() == [0, 3, 1, 4, 2, 5]
    assert torch.equal(unflatten(flat, layout)[0], t)
    flat[0] = 99.0
    assert t[0, 0].item() == 0.0  # flatten copied; the original is untouched
