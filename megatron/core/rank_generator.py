"""Megatron's rank grid: which global ranks form each tp/cp/ep/dp/pp group (pure arithmetic, no processes).

``parallel_state.initialize_model_parallel`` creates its process groups from these rank lists, and
``megatron.core.parallel_state`` re-exports every name here, so either import path works.
"""
from typing import List, Optional, Sequence

__all__ = ["generate_masked_orthogonal_rank_groups", "RankGenerator", "default_embedding_ranks",
           "default_position_embedding_ranks"]


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: Sequence[int], mask: Sequence[bool]
) -> List[List[int]]:
    """Enumerate the rank groups spanned by the masked axes of a row-major rank grid.

    The grid has axes ``parallel_size`` listed fastest-varying first, so
    ``global_rank = sum(index[i] * prod(parallel_size[:i]))``. A group is the set of ranks that
    differ only in the axes where ``mask`` is True. Groups are listed with the unmasked axes
    enumerated fastest-first, and members with the masked axes enumerated fastest-first
    (this is Megatron-LM's ordering, ``parallel_state.generate_masked_orthogonal_rank_groups``).

    Raises ValueError if the product of ``parallel_size`` is not ``world_size`` or the lengths differ.
    """
    if len(parallel_size) != len(mask):
        raise ValueError(f"parallel_size {list(parallel_size)} and mask {list(mask)} differ in length")
    total = 1
    for size in parallel_size:
        total *= size
    if total != world_size:
        raise ValueError(f"product of parallel sizes {list(parallel_size)} = {total} != world_size {world_size}")

    strides, stride = [], 1
    for size in parallel_size:
        strides.append(stride)
        stride *= size

    def offsets(axes: List[int]) -> List[int]:
        # All rank offsets spanned by `axes`, first axis varying fastest.
        result = [0]
        for axis in axes:
            result = [base + i * strides[axis] for i in range(parallel_size[axis]) for base in result]
        return result

    masked_axes = [i for i, m in enumerate(mask) if m]
    unmasked_axes = [i for i, m in enumerate(mask) if not m]
    inner = offsets(masked_axes)
    return [[base + off for off in inner] for base in offsets(unmasked_axes)]


class RankGenerator:
    """Compute Megatron rank groups for tp/cp/ep/dp/pp sizes laid out in ``order``.

    ``order`` (e.g. ``"tp-cp-ep-dp-pp"``) lists the axes fastest-varying first; axes of size 1
    may be omitted from it. ``get_ranks("dp-cp")`` returns every group of ranks that differ only
    in the dp and cp coordinates.

    Raises RuntimeError if an axis of size != 1 is missing from ``order``, and AssertionError
    if both ep and cp exceed 1 (they are laid out by different generators in Megatron).
    """

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0):
        assert ep == 1 or cp == 1, "Both EP and CP > 1 in one rank generator is not allowed."
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * dp * pp * cp * ep
        sizes = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        order = order.lower()
        names = order.split("-")
        for name in names:
            if name not in sizes:
                raise RuntimeError(f"Unknown parallelism '{name}' in order ({order}); expected tp, cp, ep, dp, pp.")
        for name, size in sizes.items():
            if name not in names:
                if size != 1:
                    raise RuntimeError(
                        f"The size of ({name}) is ({size}), but you haven't specified the order ({order})."
                    )
                names.append(name)
        self.order = "-".join(names)
        self.ordered_size = [sizes[name] for name in names]

    def get_mask(self, order: str, token: str) -> List[bool]:
        """Boolean mask over the axes of ``order`` selecting the axes named in ``token``."""
        wanted = token.split("-")
        return [name in wanted for name in order.split("-")]

    def get_ranks(self, token: str) -> List[List[int]]:
        """All rank groups spanned by the axes in ``token`` (e.g. ``"tp"``, ``"tp-pp"``)."""
        for name in token.split("-"):
            if name not in ("tp", "pp", "dp", "ep", "cp"):
                raise ValueError(f"Unknown parallelism '{name}' in token '{token}'")
        mask = self.get_mask(self.order, token)
        groups = generate_masked_orthogonal_rank_groups(self.world_size, self.ordered_size, mask)
        if self.rank_offset:
            groups = [[r + self.rank_offset for r in g] for g in groups]
        return groups


def default_embedding_ranks(pp_ranks: List[int], split_rank: Optional[int] = None) -> List[int]:
    """Ranks holding word embeddings for one pipeline: first and last stage (first only if pp=1)."""
    if len(pp_ranks) == 1:
        return [pp_ranks[0]]
    ranks = [pp_ranks[0], pp_ranks[-1]]
    if split_rank is not None and pp_ranks[split_rank] not in ranks:
        ranks = [pp_ranks[0], pp_ranks[split_rank], pp_ranks[-1]]
    return ranks


def default_position_embedding_ranks(pp_ranks: List[int], split_rank: Optional[int] = None) -> List[int]:
    """Ranks holding position embeddings for one pipeline: the first stage."""
    if len(pp_ranks) == 1 or split_rank is None or pp_ranks[split_rank] == pp_ranks[0]:
        return [pp_ranks[0]]
    return [pp_ranks[0], pp_ranks[split_rank]]
