"""Writing and reading the engines' state dicts with torch.distributed.checkpoint (DCP).

parts/state_dicts.py says what a rank's state dict holds (Chunks: rectangles of the full
tensors, views of the rank's flat shards); this file hands them to DCP. Two small planners
(subclasses of DCP's documented DefaultSavePlanner / DefaultLoadPlanner) add a write item per
piece on save and a read item per overlap on load; everything else goes through DCP's own code.
It is its own file because importing DCP costs about a second (it pulls DTensor and sympy): only
a process that saves or loads pays it, not every rank that starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from zerolab.parts.state_dicts import Chunks, Path

# ---- a nested state dict of Chunks, as DCP's items --------------------------------------------


def split(sd: dict, path: Path = ()) -> tuple[dict, dict[Path, Chunks]]:
    """A nested state dict -> (the same without its Chunks, {path: Chunks})."""
    plain, chunks = {}, {}
    for k, v in sd.items():
        if isinstance(v, Chunks):
            chunks[(*path, k)] = v
        elif isinstance(v, dict):
            plain[k], more = split(v, (*path, k))
            chunks.update(more)
        else:
            plain[k] = v
    return plain, chunks


def fqn(path: Path) -> str:
    """DCP's flat key for a nested path (its flatten_state_dict joins with dots)."""
    return ".".join(map(str, path))


class ChunkSavePlanner(dcp.DefaultSavePlanner):
    """DCP's default save planner, plus a SHARD write item for each piece of each Chunks."""

    def __init__(self, chunks: dict[Path, Chunks]):
        super().__init__()
        self.chunks = {fqn(path): (path, c) for path, c in chunks.items()}

    def create_local_plan(self):
        plan = super().create_local_plan()  # buffers, step counts, param groups
        items = []
        for key, (path, c) in self.chunks.items():
            self.mappings[key] = path  # how dcp_to_torch_save nests the key again
            for offsets, t in c.pieces:
                items.append(WriteItem(
                    index=MetadataIndex(key, torch.Size(offsets)), type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(offsets), t.size()),
                        properties=TensorProperties.create_from_tensor(t), size=c.shape)))
        self.plan = dataclasses.replace(plan, items=[*plan.items, *items],
                                        planner_data=self.mappings)
        return self.plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.chunks:
            return next(t for offsets, t in self.chunks[index.fqn][1].pieces
                        if torch.Size(offsets) == index.offset)
        return super().lookup_object(index)


class ChunkLoadPlanner(dcp.DefaultLoadPlanner):
    """DCP's default load planner, plus a read item for every overlap of a piece with a chunk
    the checkpoint holds (pieces may overlap: one key can fill several tensors)."""

    def __init__(self, chunks: dict[Path, Chunks]):
        super().__init__()
        self.chunks = {fqn(path): c for path, c in chunks.items()}

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = []
        for key, c in self.chunks.items():
            wanted = [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in c.pieces]
            items += create_read_items_for_chunk_list(
                key, self.metadata.state_dict_metadata[key], wanted)
        return LoadPlan([*plan.items, *items])

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.chunks:  # index.index: which of the pieces (the list's order)
            return self.chunks[index.fqn].pieces[index.index][1]
        return super().lookup_tensor(index)


def write(sd: dict, path: str, group: dist.ProcessGroup | None) -> None:
    """Collective over `group`: DCP writes every rank's part of `sd` into the folder `path`
    (a file per rank, then `.metadata` from the coordinator, rank 0)."""
    plain, chunks = split(sd)
    dcp.save(plain, storage_writer=dcp.FileSystemWriter(path), planner=ChunkSavePlanner(chunks),
             process_group=group)


def read(sd: dict, path: str, group: dist.ProcessGroup | None) -> None:
    """Collective over `group`: fill `sd` in place from the DCP folder `path` (Chunks pieces,
    plain tensors; other values are replaced by the checkpoint's)."""
    plain, chunks = split(sd)
    dcp.load(plain, storage_reader=dcp.FileSystemReader(path), planner=ChunkLoadPlanner(chunks),
             process_group=group)
    _copy_back(sd, plain)


def _copy_back(sd: dict, plain: dict) -> None:
    """DCP replaces non-tensor values in the dict it was given: take them back into `sd`."""
    for k, v in plain.items():
        if isinstance(v, dict):
            _copy_back(sd[k], v)
        else:
            sd[k] = v


def read_metadata(path: str) -> Metadata:
    return dcp.FileSystemReader(path).read_metadata()


def paths(metadata: Metadata) -> dict[str, Path]:
    """Each key of a DCP checkpoint -> its path in the nested state dict that was saved."""
    nested = metadata.planner_data or {}
    return {k: tuple(nested.get(k, (k,))) for k in metadata.state_dict_metadata}
