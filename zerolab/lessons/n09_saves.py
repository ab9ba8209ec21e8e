"""Notebook 09b, built and saved at scale: models born sharded, checkpoints that outlive their job.

The GPT of notebook 09 (n09_nodes.MODEL), trained with SGD as there (n09_nodes.sgd_run):

- `construction` builds it with ZeRO-3 twice, in full then wrapped, and on the meta device,
  and measures the peak bytes of each (`Construction`);
- `saved_lesson` (4 ranks) measures the construction at N = 4, saves a ZeRO-3 checkpoint after
  2 steps, and runs 5 steps uninterrupted, to compare resumes with (`Saved`);
- `resumed_lesson` (2 or 3 ranks) measures the construction at that N and resumes the
  checkpoint with another stage (`Resumed`); `at_two` and `at_three` add notebook 09b's DCP
  round trips (lessons/n09_dcp.py) to the same launches, so that the notebook launches less;
- `chunks_in` lists what one rank's file holds; `crash_mid_save` kills a rank half-way
  through a save and says what is left (`Crash`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from zerolab import engines, harness
from zerolab.lessons import n09_dcp
from zerolab.lessons.n09_nodes import MODEL, SGD, batch, rank_and_size, sgd_run
from zerolab.memory import track_memory
from zerolab.models import GPT, GPTConfig, num_params

# ---- models born sharded ----------------------------------------------------------------------


@dataclass
class Construction:
    """Building the model and its ZeRO-3 engine on one rank: in full, or on the meta device."""

    world_size: int
    peak_full: int  # the most bytes alive while the model was built whole, then wrapped
    peak_meta: int  # the same, built on the meta device, materialised one unit at a time
    kept: dict[str, int]  # model-state bytes held afterwards (parameter and gradient shards)
    full_model_bytes: int  # 4Ψ
    largest_unit_bytes: int  # the biggest unit, gathered (ZeRO-3 builds one at a time)
    same: bool  # the two engines hold bitwise the same model


def construction(config: GPTConfig = MODEL) -> Construction:
    """Build `config` twice with ZeRO-3: whole then wrapped, and on the meta device."""
    peaks, states = {}, {}
    for meta in (False, True):
        with track_memory() as trace:
            if meta:
                with torch.device("meta"):  # shapes only: no storage, no values yet
                    model = GPT(config)
            else:
                model = GPT(config)
            engine = engines.make_engine("zero3", model, torch.optim.AdamW, lr=1e-3)
        peaks[meta], states[meta] = trace.peak_bytes, engine.full_state_dict()
    units = [sum(4 * b.layout.padded_numel for b in u.buckets) for u in engine.units]
    return Construction(rank_and_size()[1], peaks[False], peaks[True],
                        engine.model_state_bytes(), 4 * num_params(GPT(config)), max(units),
                        harness.max_diff(states[False], states[True]) == 0.0)


# ---- the launches: 4 ranks save, 2 and 3 resume -----------------------------------------------


@dataclass
class Saved:
    """What the 4-rank launch measures, on one rank."""

    construction: Construction
    straight: dict[str, torch.Tensor] = field(default_factory=dict)  # rank 0: 5 SGD steps


def saved_lesson(folder: str) -> Saved:
    """On 4 ranks: the construction at N = 4; ZeRO-3 saves in `folder` after 2 SGD steps; the
    same run, uninterrupted, to step 5."""
    built = construction()
    sgd_run("ZeRO-3", range(2), save_to=folder)
    straight = sgd_run("ZeRO-3", range(5))
    return Saved(built, straight if rank_and_size()[0] == 0 else {})


@dataclass
class Resumed:
    """On 2 or 3 ranks: the construction at this N, and the checkpoint resumed."""

    construction: Construction
    variant: str  # the stage that resumed the 4-rank ZeRO-3 checkpoint
    state: dict[str, torch.Tensor]  # its weights after steps 2, 3 and 4


def resumed_lesson(folder: str, variant: str, shard_size: int | None = None) -> Resumed:
    """Construction at this world size; then `variant` (HSDP: nodes of `shard_size`) loads the
    checkpoint saved after step 2 and trains steps 2 to 4, as the uninterrupted run did."""
    return Resumed(construction(), variant,
                   sgd_run(variant, range(2, 5), load_from=folder,
                           **({"shard_size": shard_size} if shard_size else {})))


def at_two(folder: str, workdir: str) -> tuple[Resumed, dict, dict]:
    """On 2 ranks: ZeRO-2 resumes `folder`; then the round trips' first two legs
    (n09_dcp.zerolab_saves into workdir/zero3, n09_dcp.fsdp2_loads_and_saves into
    workdir/fsdp2)."""
    resumed = resumed_lesson(folder, "zero2")
    zero3 = os.path.join(workdir, "zero3")
    saved = n09_dcp.zerolab_saves(zero3)
    return resumed, saved, n09_dcp.fsdp2_loads_and_saves(zero3, os.path.join(workdir, "fsdp2"))


def at_three(folder: str, workdir: str) -> tuple[Resumed, dict]:
    """On 3 ranks: HSDP as one node of 3 resumes `folder`; then ZeRO-2 loads FSDP2's
    checkpoint (n09_dcp.zerolab_loads, workdir/fsdp2 -> workdir/zero2)."""
    resumed = resumed_lesson(folder, "HSDP", 3)
    return resumed, n09_dcp.zerolab_loads(os.path.join(workdir, "fsdp2"),
                                          os.path.join(workdir, "zero2"))


# ---- checkpoints: what a file holds, and a crash mid-save ----------------------------------


@dataclass
class ChunkSummary:
    """One chunk of one tensor in one rank's file of a DCP checkpoint."""

    key: str  # "model.blocks.0.qkv.weight", "optimizer.state.wte.weight.momentum_buffer"
    offsets: tuple[int, ...]  # its first element in the full tensor
    sizes: tuple[int, ...]  # its extent: a rectangle of the full tensor
    nbytes: int  # bytes in the file


def chunks_in(folder: str, rank: int) -> list[ChunkSummary]:
    """What rank `rank` wrote in the last complete save in `folder` (its file, in file order),
    read from DCP's manifest."""
    from zerolab import checkpoint

    metadata = checkpoint.manifest(checkpoint.latest(folder))
    mine = sorted(((info.offset, index, info.length) for index, info in
                   metadata.storage_data.items() if info.relative_path == f"__{rank}_0.distcp"),
                  key=lambda item: item[0])
    out = []
    for _, index, length in mine:
        sizes = next((c.sizes for c in metadata.state_dict_metadata[index.fqn].chunks
                      if c.offsets == index.offset), ()) if index.offset is not None else ()
        out.append(ChunkSummary(index.fqn, tuple(index.offset or ()), tuple(sizes), length))
    return out


def save_killed_half_way(folder: str) -> None:
    """Load the checkpoint into ZeRO-2, train one step, save: and die half-way through the
    save, after this rank's file is written, before the manifest (.metadata) and LATEST are."""
    import torch.distributed.checkpoint as dcp

    from zerolab import checkpoint

    def dies_writing_the_manifest(writer, metadata, results) -> None:
        os._exit(1)  # a crash: no exception, no clean-up, the process is gone

    model = GPT(MODEL)
    engine = engines.make_engine("zero2", model, torch.optim.SGD, **SGD)
    checkpoint.load(engine, folder)
    harness.train_step(engine, *batch(model, 2))
    dcp.FileSystemWriter.finish = dies_writing_the_manifest  # DCP writes the manifest last
    checkpoint.save(engine, folder)


@dataclass
class Crash:
    """What a save killed half-way leaves in the folder."""

    error: str  # what zerolab.launch reported
    before: list[str]  # the folder's entries before the crashed save
    after: list[str]  # and after it
    latest: str  # the version LATEST names afterwards
    crashed_files: list[str]  # what the unfinished version holds (no .metadata)
    same_as_before: bool  # the checkpoint that loads now is bitwise the one saved before


def crash_mid_save(folder: str) -> Crash:
    """In this process: launch a rank that dies half-way through a save in `folder`."""
    import zerolab
    from zerolab import checkpoint

    before, good = sorted(os.listdir(folder)), checkpoint.consolidate(folder)
    try:
        zerolab.launch(save_killed_half_way, 1, args=(folder,), timeout=300)
        error = "no error"
    except zerolab.WorkerError as e:
        error = str(e).splitlines()[0]
    after = sorted(os.listdir(folder))
    crashed = [v for v in after if v.startswith("save-") and v not in before]
    now = checkpoint.consolidate(folder)
    return Crash(error, before, after, os.path.basename(checkpoint.latest(folder)),
                 sorted(os.listdir(os.path.join(folder, crashed[0]))) if crashed else [],
                 harness.max_diff(now["model"], good["model"]) == 0.0)
