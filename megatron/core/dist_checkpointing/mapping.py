"""Sharded-tensor metadata: where a rank's local piece of a tensor lies in the global (unsharded) tensor.

A checkpoint in the ``torch_dist`` format stores every tensor under a global name with its global
shape; each rank contributes the rectangular chunks it holds, described by their global offsets.
Any rank of any other parallel layout can then read the chunks it needs (torch.distributed.checkpoint
intersects the saved chunks with the requested ones).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import torch


@dataclasses.dataclass
class ShardedTensor:
    """One rectangular chunk of a global tensor held by this rank.

    Attributes:
        key: global name of the tensor (the same on every rank and every parallel layout).
        data: the chunk, ``shape == local shape``. For loading it must be a view of the live
            storage (parameters, optimizer state): the checkpoint is read into it in place.
        global_shape: shape of the whole tensor.
        global_offset: offset of ``data`` in the whole tensor, one entry per dimension.
        allow_shape_mismatch: dimension 0 of the saved tensor may differ from ``global_shape[0]``
            (the vocabulary padding, which depends on the tensor-parallel size): loading reads the
            rows both have and leaves the others as they are.
        replica: a copy of a tensor that another rank saves (the last pipeline stage's tied output
            weight): loaded, never saved (two differently cut copies would overlap in the checkpoint).
        orig_global_shape: for a flattened tensor (Megatron's distributed-optimizer form), the shape
            of the parameter it flattens; recorded in ``.metadata`` (``mcore_data``) for Megatron's loader.
    """

    key: str
    data: torch.Tensor
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    allow_shape_mismatch: bool = False
    replica: bool = False
    orig_global_shape: Optional[Tuple[int, ...]] = None

    def __post_init__(self):
        self.global_shape = tuple(int(v) for v in self.global_shape)
        self.global_offset = tuple(int(v) for v in self.global_offset)
        if not (len(self.global_shape) == len(self.global_offset) == self.data.dim()):
            raise ValueError(f"sharded tensor {self.key}: local shape {tuple(self.data.shape)}, global shape "
                             f"{self.global_shape} and offset {self.global_offset} differ in rank")
        for dim, (size, offset, length) in enumerate(zip(self.global_shape, self.global_offset, self.data.shape)):
            if offset < 0 or offset + length > size:
                raise ValueError(f"sharded tensor {self.key}: chunk [{offset}, {offset + length}) of dimension {dim} "
                                 f"lies outside the global size {size}")


@dataclasses.dataclass
class ShardedObject:
    """A serialized non-tensor entry (Megatron's ``ShardedObject``), written as bytes under ``key``.

    ``key`` is the full stored key (``<name>/shard_<offsets>_<global shape>``, dot-joined); ``data``
    the bytes (``torch.save`` output). Written for Megatron's loader; this project never unpickles
    them.
    """

    key: str
    data: bytes
    replica: bool = False


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How a tensor-parallel rank's local tensor maps into the global tensor.

    The local tensor is split along ``partition_dim`` (None: replicated) into ``stride`` equal
    pieces; piece ``j`` of rank ``r`` is rows ``j * G/stride + r * L/stride ...`` of the global
    tensor along that dimension (``L`` local, ``G = L * tp_size`` global size). ``stride`` 2 is the
    gated MLP's fc1 (``[gate_r; up_r]`` per rank, ``[gate; up]`` globally).
    """

    local_shape: Tuple[int, ...]
    partition_dim: Optional[int]
    stride: int
    tp_rank: int
    tp_size: int

    @property
    def global_shape(self) -> Tuple[int, ...]:
        shape = list(self.local_shape)
        if self.partition_dim is not None:
            shape[self.partition_dim] *= self.tp_size
        return tuple(shape)

    def split_box(self, offsets: Sequence[int], sizes: Sequence[int]) -> List[Tuple[Tuple[int, ...], Tuple[int, ...],
                                                                                   Tuple[int, ...]]]:
        """A box of the local tensor -> ``[(local offsets, sizes, global offsets)]``, one per stride piece it meets."""
        offsets, sizes = list(offsets), list(sizes)
        if self.partition_dim is None:
            return [(tuple(offsets), tuple(sizes), tuple(offsets))]
        dim = self.partition_dim
        local = self.local_shape[dim]
        if local % self.stride:
            raise ValueError(f"local size {local} along dimension {dim} is not divisible by stride {self.stride}")
        piece = local // self.stride
        global_piece = piece * self.tp_size
        out = []
        lo, hi = offsets[dim], offsets[dim] + sizes[dim]
        for j in range(self.stride):
            start, end = max(lo, j * piece), min(hi, (j + 1) * piece)
            if start >= end:
                continue
            local_offsets, box_sizes, global_offsets = list(offsets), list(sizes), list(offsets)
            local_offsets[dim], box_sizes[dim] = start, end - start
            global_offsets[dim] = j * global_piece + self.tp_rank * piece + (start - j * piece)
            out.append((tuple(local_offsets), tuple(box_sizes), tuple(global_offsets)))
        return out


def _narrow(tensor: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        if offset != 0 or size != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, size)
    return tensor


def local_rows(tensor: torch.Tensor) -> Tuple[torch.Tensor, int]:
    """``(data, row offset)``: the rows of a tensor-parallel-local ``tensor`` this rank holds.

    A plain tensor is all of itself (offset 0). A ``DTensor`` sharded ``Shard(0)`` over a
    one-dimensional mesh (FSDP2's parameters, grads and Adam moments) holds torch's ``chunk`` piece
    of dimension 0: ``ceil(rows / mesh size)`` rows per rank, fewer (possibly none) on the last
    ones; ``data`` is its local tensor, a view of the live storage.

    Raises ValueError for any other DTensor placement.
    """
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor, 0
    if len(tensor.placements) != 1 or tensor.placements[0] != Shard(0):
        raise ValueError(f"DTensor placements {tensor.placements} are not supported in checkpoints (only Shard(0) "
                         "over a one-dimensional mesh, FSDP2's layout)")
    mesh = tensor.device_mesh
    rows = tensor.shape[0]
    per_rank = -(-rows // mesh.size())
    offset = min(mesh.get_local_rank() * per_rank, rows)
    data = tensor.to_local()
    if data.shape[0] != min(per_rank, rows - offset):
        raise ValueError(f"DTensor local shard has {data.shape[0]} rows, expected {min(per_rank, rows - offset)} "
                         f"from row {offset} of {rows}")
    return data, offset


def sharded_tensors_of_local(key: str, tensor: torch.Tensor, layout: TPLayout,
                             allow_shape_mismatch: bool = False, replica: bool = False) -> List[ShardedTensor]:
    """The chunks of a whole tensor-parallel-local ``tensor`` (a parameter or a same-shaped state).

    For an FSDP2 ``DTensor`` only this rank's rows (:func:`local_rows`) at their global offsets: the
    same keys and global shapes as without FSDP, so either run reads the other's checkpoint.
    """
    data, row = local_rows(tensor)
    if data is not tensor and data.numel() == 0:  # an FSDP2 rank past the last rows holds nothing to save
        return []
    offsets = [row] + [0] * (data.dim() - 1)
    out = []
    for local_offsets, sizes, global_offsets in layout.split_box(offsets, list(data.shape)):
        relative = [lo - o for lo, o in zip(local_offsets, offsets)]
        out.append(ShardedTensor(key, _narrow(data, relative, sizes), layout.global_shape, global_offsets,
                                 allow_shape_mismatch, replica))
    return out


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> List[Tuple[int, Tuple[int, ...], Tuple[int, ...]]]:
    """Split the range ``[start, end)`` of a row-major flattened tensor of ``shape`` into boxes.

    Returns ``[(flat start, box offsets, box sizes)]``: at most three boxes for a 2-D shape (a
    partial first row, whole middle rows, a partial last row), one for 1-D. Raises ValueError for
    more than two dimensions.
    """
    shape = list(shape)
    if len(shape) == 1:
        return [(start, (start,), (end - start,))] if end > start else []
    if len(shape) != 2:
        raise ValueError(f"flat ranges of {len(shape)}-D tensors are not supported (shape {tuple(shape)})")
    cols = shape[1]
    boxes = []
    position = start
    while position < end:
        row, col = divmod(position, cols)
        if col != 0 or end - position < cols:  # a partial row
            length = min(cols - col, end - position)
            boxes.append((position, (row, col), (1, length)))
            position += length
        else:
            rows = (end - position) // cols
            boxes.append((position, (row, 0), (rows, cols)))
            position += rows * cols
    return boxes


def sharded_tensors_of_flat_range(key: str, flat: torch.Tensor, param_shape: Sequence[int], start: int,
                                  layout: TPLayout, allow_shape_mismatch: bool = False,
                                  replica: bool = False) -> List[ShardedTensor]:
    """The chunks of ``flat``: elements ``[start, start + flat.numel())`` of the flattened local param.

    This is how the distributed optimizer holds fp32 main params and Adam moments (a contiguous
    range of each parameter per data-parallel rank); each returned chunk is a view of ``flat``.
    """
    out = []
    end = start + flat.numel()
    for flat_start, offsets, sizes in flat_range_boxes(param_shape, start, end):
        numel = 1
        for size in sizes:
            numel *= size
        box = flat[flat_start - start:flat_start - start + numel].view(*sizes)
        for local_offsets, sub_sizes, global_offsets in layout.split_box(offsets, sizes):
            relative = [lo - o for lo, o in zip(local_offsets, offsets)]
            out.append(ShardedTensor(key, _narrow(box, relative, sub_sizes), layout.global_shape, global_offsets,
                                     allow_shape_mismatch, replica))
    return out
