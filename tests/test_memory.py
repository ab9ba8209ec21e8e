"""zerolab.memory: distinct storages, and the tracker on cases whose answer is known exactly."""

import weakref

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from workers import memory as WM

import zerolab
from zerolab import models
from zerolab.memory import (
    CATEGORIES,
    InFlight,
    Settled,
    distinct_bytes,
    model_state_bytes,
    module_state,
    optimizer_tensors,
    track_memory,
)

# --- model_state_bytes: every storage once ----------------------------------------------------


def test_views_count_their_storage_once():
    base = torch.zeros(10)  # 40 bytes
    assert distinct_bytes([base]) == 40
    assert distinct_bytes([base, base[2:5], base.view(2, 5), base[::2]]) == 40
    # A view alone stands for its whole storage: that memory is held as long as the view lives.
    assert distinct_bytes([base[:2]]) == 40
    assert distinct_bytes([base, torch.zeros(3, dtype=torch.float64)]) == 40 + 24
    assert distinct_bytes([]) == 0


def test_empty_and_freed_storages_count_nothing():
    freed = torch.zeros(100)
    freed.untyped_storage().resize_(0)  # how ZeRO-3 frees a gathered unit
    assert distinct_bytes([freed, torch.zeros(0)]) == 0


def test_a_storage_shared_by_two_categories_counts_in_the_first():
    flat = torch.zeros(8)  # 32 bytes, e.g. a flat buffer whose views are params and grads
    got = model_state_bytes({"params": [flat[:4]], "grads": [flat[4:]],
                             "optimizer": [torch.zeros(2)]})
    assert got == {"params": 32, "grads": 0, "optimizer": 8}
    assert model_state_bytes({}) == {"params": 0, "grads": 0, "optimizer": 0}


def test_module_and_adam_state_by_category():
    model = nn.Linear(3, 2)  # weight 6 + bias 2 = 8 fp32 = 32 bytes
    opt = torch.optim.Adam(model.parameters())
    assert model_state_bytes(module_state(model, opt)) == {"params": 32, "grads": 0,
                                                           "optimizer": 0}
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    # Adam: exp_avg + exp_avg_sq (32 bytes each) and one fp32 `step` scalar per parameter.
    assert model_state_bytes(module_state(model, opt)) == {"params": 32, "grads": 32,
                                                           "optimizer": 32 + 32 + 4 + 4}
    assert model_state_bytes(module_state(model, None))["optimizer"] == 0


def test_mlp_frozen_parameter_has_no_grad_or_optimizer_state():
    model = models.MLP()  # dims (16, 32, 32, 8) + gain: 1865 parameters, 32 of them frozen
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    x, y = model.make_batch(4)
    model.loss(model(x), y).backward()
    opt.step()
    got = model_state_bytes(module_state(model, opt))
    # 6 trainable parameters (3 weights, 2 biases, gain) -> 6 fp32 `step` scalars
    assert got == {"params": 1865 * 4, "grads": 1833 * 4, "optimizer": 2 * 1833 * 4 + 6 * 4}


def test_tied_weights_count_once():
    gpt = models.GPT(models.GPTConfig(tie_weights=True))
    untied = models.GPT(models.GPTConfig(tie_weights=False))
    wte_bytes = 64 * 32 * 4  # vocab x n_embd, fp32
    tied_params = model_state_bytes(module_state(gpt, None))["params"]
    assert tied_params == models.num_params(gpt) * 4
    assert model_state_bytes(module_state(untied, None))["params"] == tied_params + wte_bytes
    # Even when both names are listed explicitly, the one storage counts once.
    both = [gpt.wte.weight, gpt.lm_head.weight]
    assert distinct_bytes(both) == wte_bytes


# --- track_memory -----------------------------------------------------------------------------


def totals(trace) -> list[int]:
    return [sum(by_category.values()) for _, by_category in trace.samples]


def test_allocate_then_free_peaks_at_the_allocation():
    with track_memory() as trace:
        x = torch.empty(256)  # 1024 bytes
        del x
    assert trace.peak_bytes == 1024
    assert trace.peak_by_category == {"params": 0, "grads": 0, "optimizer": 0, "other": 1024}
    assert totals(trace)[0] == 0 and totals(trace)[-1] == 0  # nothing before, nothing after
    assert trace.device_peak_bytes is None  # CPU


def test_rises_subtract_what_was_live_at_entry_for_the_tracker_and_the_allocator(monkeypatch):
    """On CUDA the allocator counts every tensor of the process (the bench keeps several models
    in one rank): what it and the tracker saw the block add is what compares. The allocator is
    stood in for here (this machine has no GPU); .ci/gpu_check reads the real one."""
    held = nn.Linear(4, 4)  # 80 bytes of state, live at entry
    allocated = {"now": 1_000_000, "peak": 0}  # another model's megabyte, live throughout
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: allocated["peak"])
    with track_memory(lambda: {"params": list(held.parameters())}) as trace:
        x = torch.empty(256)  # 1024 bytes
        allocated["peak"] = allocated["now"] + 1024
        del x
    assert trace.peak_bytes == 80 + 1024
    assert trace.device_entry_bytes == 1_000_000 and trace.device_peak_bytes == 1_001_024
    assert trace.rises() == (1024, 1024)


def test_two_live_at_once_add_up_and_frees_are_seen():
    with track_memory() as trace:
        a = torch.empty(100)  # 400
        b = torch.empty(50)  # 200: 600 live
        del a
        c = torch.empty(25)  # 100: 300 live
        del b, c
        d = torch.empty(100)  # 400 again: not 1000, the first 400 were freed
        del d
    assert trace.peak_bytes == 600
    # A sample is taken after each op (and at exit): a free shows at the next one.
    assert totals(trace) == [0, 400, 600, 300, 400, 0]


def test_a_view_or_an_in_place_op_adds_nothing():
    with track_memory() as trace:
        a = torch.empty(100)
        v = a[10:20]
        w = a.view(10, 10)
        a.add_(1)
        w.mul_(2)
        del a, v, w
    assert trace.peak_bytes == 400
    assert totals(trace) == [0, 400, 0]


def test_tensors_from_before_the_block_are_not_counted_unless_categorized():
    big = torch.zeros(1000)
    with track_memory() as trace:
        x = big + 1  # a new 4000-byte result
        del x
    assert trace.peak_bytes == 4000
    del big


def sync():
    """An op that allocates nothing: the tracker samples (and categorizes) after every op."""
    torch.empty(0)


def test_categories_come_from_the_categorize_callable():
    param = torch.zeros(16)  # 64 bytes, present at entry
    grads: list[torch.Tensor] = []
    optimizer_state: list[torch.Tensor] = []

    def categorize():
        return {"params": [param], "grads": grads, "optimizer": optimizer_state}

    with track_memory(categorize) as trace:
        activation = param * 2  # 64 bytes of "other"
        grads.append(torch.ones_like(param))  # 64: "other" until categorize returns it
        sync()
        after_grad = trace.samples[-1][1]
        optimizer_state.append(torch.zeros(32))  # 128
        sync()
        after_state = trace.samples[-1][1]
        del activation
        grads.clear()  # the list held the only reference: freed
        sync()
    assert trace.samples[0][1] == {"params": 64, "grads": 0, "optimizer": 0, "other": 0}
    assert after_grad == {"params": 64, "grads": 64, "optimizer": 0, "other": 64}
    assert after_state == {"params": 64, "grads": 64, "optimizer": 128, "other": 64}
    assert trace.samples[-1][1] == {"params": 64, "grads": 0, "optimizer": 128, "other": 0}
    assert trace.peak_bytes == 64 + 64 + 128 + 64
    # The optimizer state was "other" in the sample right after its allocation (192 = 64 + 128).
    assert trace.max_by_category == {"params": 64, "grads": 64, "optimizer": 128, "other": 192}


def test_storage_resized_in_place_shows_at_the_next_sample():
    with track_memory() as trace:
        a = torch.empty(100)  # 400
        a.untyped_storage().resize_(0)  # freed in place; `a` itself still lives
        b = torch.empty(1)  # next op: the next sample
        after_free = trace.samples[-1][1]["other"]
        a.untyped_storage().resize_(400)  # regrown (a ZeRO-3 unit gathered again)
        c = torch.empty(1)
        after_regrow = trace.samples[-1][1]["other"]
        del a, b, c
    assert after_free == 4  # only b
    assert after_regrow == 408
    assert trace.peak_bytes == 408
    assert totals(trace)[-1] == 0


def test_peak_is_the_largest_total_and_times_increase():
    with track_memory() as trace:
        xs = [torch.empty(10 * (i + 1)) for i in range(5)]  # 40+80+...+200 = 600 live
        del xs
        y = torch.empty(140)  # 560 < 600
        del y
    assert trace.peak_bytes == 600 == max(totals(trace))
    assert sum(trace.peak_by_category.values()) == trace.peak_bytes
    times = [t for t, _ in trace.samples]
    assert times == sorted(times)


def test_trace_is_closed_at_exit():
    with track_memory() as trace:
        x = torch.empty(10)
    n = len(trace.samples)
    del x
    torch.empty(100)
    assert len(trace.samples) == n  # nothing recorded after the block


# --- "comm": buffers a collective is using now ----------------------------------------------


def test_in_flight_lists_buffers_without_keeping_them_alive():
    in_flight = InFlight()
    full, received = torch.zeros(8), torch.zeros(2)
    in_flight.add(full, received)
    assert {id(t) for t in in_flight.tensors()} == {id(full), id(received)}
    del full  # freed by the code that made it: no longer listed, and not kept alive for it
    assert [id(t) for t in in_flight.tensors()] == [id(received)]


def test_comm_is_a_category_of_its_own_and_no_model_state():
    param, buffer = torch.zeros(16), torch.zeros(4)  # 64 and 16 bytes
    state = {"params": [param], "grads": [], "optimizer": [], "comm": [buffer]}
    assert model_state_bytes(state) == {"params": 64, "grads": 0, "optimizer": 0}
    with track_memory(lambda: state) as trace:
        scratch = torch.ones(2)  # 8 bytes: a temporary, "other"
        sync()
        del scratch
    assert trace.max_by_category == {"params": 64, "grads": 0, "optimizer": 0, "comm": 16,
                                     "other": 8}
    assert list(trace.samples[0][1]) == ["params", "grads", "optimizer", "comm", "other"]


@pytest.mark.parametrize("engine_cls, kwargs", [
    ("ZeRO2", {}),  # the flattened full gradient of the bucket being reduce-scattered
    ("ZeroPP", {"quantize_weights": True}),  # qwZ: int8 values and scales gathered
])
def test_engines_list_their_buffers_in_flight_as_comm(engine_cls, kwargs):
    """One rank, no process group: the collectives are local copies, the buffers the same."""
    torch.manual_seed(0)
    model = models.MLP()
    engine = getattr(zerolab, engine_cls)(model, torch.optim.AdamW, lr=1e-3, **kwargs)
    x, y = model.make_batch(4)
    with track_memory(engine.state_tensors) as trace:
        model.loss(engine(x), y).backward()
        engine.step()
    assert trace.max_by_category["comm"] > 0
    assert set(engine.model_state_bytes()) == {"params", "grads", "optimizer"}
    if engine_cls == "ZeRO2":  # at least one bucket's full gradient, flattened and padded
        smallest = min(4 * b.layout.padded_numel for b in engine.buckets)
        assert trace.max_by_category["comm"] >= smallest
    assert trace.samples[-1][1]["comm"] == 0  # nothing in flight once the step is done


# --- what tracking costs, counted -----------------------------------------------------------


class EveryOp(TorchDispatchMode):
    """The specification, done the slow way: after every op, every live storage's bytes, in
    the first category that lists it now (else "other"); a sample when the totals change."""

    def __init__(self, categorize):
        super().__init__()
        self.categorize, self.live, self.samples = categorize, {}, []

    def watch(self, t):
        storage = t.untyped_storage()
        ref = self.live.get(id(storage))
        if ref is None or ref() is not storage:
            self.live[id(storage)] = weakref.ref(storage)

    def sample(self):
        categories = {name: list(ts) for name, ts in self.categorize().items()}
        category_of = {}
        for name, ts in categories.items():
            for t in ts:
                self.watch(t)
                category_of.setdefault(id(t.untyped_storage()), name)
        by_category = dict.fromkeys((*CATEGORIES, *categories, "other"), 0)
        for key, ref in list(self.live.items()):
            if (storage := ref()) is not None:
                by_category[category_of.get(key, "other")] += storage.nbytes()
        if not self.samples or self.samples[-1] != by_category:
            self.samples.append(by_category)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.watch(t)
        self.sample()
        return out


def adam_twins(seed: int = 0):
    """Two identical MLPs with AdamW, whose optimizer state does not exist yet."""
    out = []
    for _ in range(2):
        torch.manual_seed(seed)
        model = models.MLP()
        out.append((model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    return out


def test_the_tracker_gives_the_figures_of_reading_everything_after_every_op():
    """The tracker reads the Settled optimizer state when a step is over and nothing inside
    optimizer.step(); what the step made and kept (Adam's moments, in the first step) is
    relabelled from the op after the one that made it. Two identical training steps, one
    tracked, one read after every op (EveryOp), agree sample for sample."""
    (model, opt), (twin, twin_opt) = adam_twins()

    def categorize():
        state = module_state(model, opt)
        state["optimizer"] = Settled(lambda: optimizer_tensors(opt))
        return state

    x, y = model.make_batch(4, seed=1)
    for first in (True, False):  # the first step makes the optimizer state, the second uses it
        with track_memory(categorize) as trace:
            model.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        spec = EveryOp(lambda: module_state(twin, twin_opt))
        spec.sample()
        with spec:
            twin.loss(twin(x), y).backward()
            twin_opt.step()
            twin_opt.zero_grad()
        spec.sample()
        assert [d for _, d in trace.samples] == spec.samples, first
        assert trace.full_reads == 3  # entry, once the step was over, exit
        assert trace.max_by_category["optimizer"] > 0


def ddp_with_tiles(tile_numel: int | None):
    """zerolab's DDP on one process, its optimizer given tiles of tile_numel (None: whole
    parameters), after one step (the optimizer state exists)."""
    torch.manual_seed(0)
    model = models.GPT(models.GPTConfig())
    engine = zerolab.DDP(model, torch.optim.AdamW, lr=1e-3, optimizer_tile_numel=tile_numel)
    x, y = model.make_batch(4, seed=0)
    model.loss(engine(x), y).backward()
    engine.step()
    engine.zero_grad()
    return engine, model, x, y


def test_work_after_each_op_does_not_grow_with_the_optimizers_tensors():
    """The tracker looks at an op's outputs, what categorize lists now (not the Settled
    optimizer state) and the sizes of storages that may be resized; never at every optimizer
    tensor after every op. Counted, not timed: the same forward and backward cost the same
    work whether the optimizer holds a few tensors or hundreds."""
    runs = {}
    for tiles in (None, 64):
        engine, model, x, y = ddp_with_tiles(tiles)
        held = sum(1 for _ in engine.state_tensors()["optimizer"])
        with track_memory(engine.state_tensors) as passes:
            model.loss(engine(x), y).backward()
        with track_memory(engine.state_tensors) as step:
            engine.step()
        runs[tiles] = held, passes, step
    (few, few_passes, few_step), (many, many_passes, many_step) = runs[None], runs[64]
    assert many >= 10 * few  # the tiles: hundreds of optimizer tensors instead of dozens
    assert (many_passes.ops, many_passes.visits) == (few_passes.ops, few_passes.visits)
    assert many_passes.full_reads == few_passes.full_reads == 2  # entry and exit
    # The step runs an op per tile; after each, only its outputs are looked at.
    assert many_step.ops > 10 * few_step.ops
    assert many_step.visits / many_step.ops <= few_step.visits / few_step.ops
    assert many_step.full_reads == few_step.full_reads == 3  # entry, step over, exit


def test_a_dtensor_counts_its_local_shard_not_the_whole_tensor():
    """A DTensor holds no memory of its own (its storage reports the global size but has no
    data): the tracker counts the local shard its op made, on every rank; so does the grader's
    (a learner's engine may hold DTensors)."""
    for res in zerolab.launch(WM.dtensor_op_bytes, 2, timeout=120):
        assert res["peak"] == res["local"] == res["global"] // 2
        assert res["grader"] == res["grader_local"] == res["global"] // 2


@pytest.mark.parametrize("engine_cls", ["ZeRO2", "ZeRO3"])
def test_sharded_engines_at_rest_hold_their_state_and_nothing_else(engine_cls):
    """One rank, the engine built inside the tracker: after backward and step(), every storage
    still alive is the engine's state or the model's buffers. The full gradients and the flat
    buffers ZeRO-2 frees must not outlive them through a reference left behind (DDP's .grad
    views: 4Ψ)."""
    torch.manual_seed(0)
    built = {}

    def state():
        return built["engine"].state_tensors() if built else {}

    with track_memory(state) as trace:
        model = models.MLP()
        built["engine"] = engine = getattr(zerolab, engine_cls)(model, torch.optim.AdamW, lr=1e-3)
        x, y = model.make_batch(4)
        model.loss(engine(x), y).backward()
        engine.step()
        del x, y
        sync()
        at_rest = trace.samples[-1][1]
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())  # in no category
    assert at_rest["other"] == buffers, at_rest
    assert at_rest["params"] > 0 and at_rest["optimizer"] > 0
