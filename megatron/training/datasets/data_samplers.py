"""Batch samplers that resume from consumed_samples, and the DataLoader that pretraining reads batches from."""
from __future__ import annotations

import signal
from functools import partial
from typing import Any, Iterator, List, Optional, Sequence

import torch

from megatron.core.datasets.utils import Split


def _check_common(total_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int) -> None:
    if total_samples <= 0:
        raise ValueError(f"no sample to consume: the dataset has {total_samples} samples")
    if micro_batch_size <= 0:
        raise ValueError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if data_parallel_size <= 0:
        raise ValueError(f"data-parallel size must be positive, got {data_parallel_size}")
    if not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(
            f"data_parallel_rank should be in [0, {data_parallel_size}), got {data_parallel_rank}"
        )


class MegatronPretrainingSampler:
    """Sequential batch sampler (``--dataloader-type single``).

    Walks sample indices ``consumed_samples, consumed_samples+1, ...``; every group of
    ``micro_batch_size * data_parallel_size`` consecutive indices is one global micro-step, of which
    DP rank r takes ``[r*mbs, (r+1)*mbs)``. The last partial group is dropped unless ``drop_last`` is
    False (then each rank takes its slice of it, if non-empty). Resuming with the consumed count
    continues exactly the same stream.

    Yields:
        lists of ``micro_batch_size`` sample indices.

    Raises:
        ValueError: an empty dataset, ``consumed_samples >= total_samples``, or bad sizes/ranks.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        _check_common(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(f"no samples left to consume: consumed {consumed_samples} of {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.drop_last = drop_last

    def __len__(self) -> int:
        return self.total_samples

    def get_start_end_idx(self) -> tuple:
        """This rank's slice ``[start, end)`` of a global micro-step."""
        start_idx = self.data_parallel_rank * self.micro_batch_size
        return start_idx, start_idx + self.micro_batch_size

    def __iter__(self) -> Iterator[List[int]]:
        start, end = self.get_start_end_idx()
        group = self.micro_batch_times_data_parallel_size
        first = self.consumed_samples
        full_groups = (self.total_samples - first) // group
        for g in range(full_groups):
            base = first + g * group
            yield list(range(base + start, base + end))
        tail_begin = first + full_groups * group
        if tail_begin < self.total_samples and not self.drop_last:
            tail = list(range(tail_begin, self.total_samples))[start:end]
            if tail:
                yield tail


class MegatronPretrainingRandomSampler:
    """Random per-epoch batch sampler (``--dataloader-type cyclic``).

    Each pass over the sampler is one epoch, shuffled with a ``torch.Generator`` seeded by the epoch
    number (``consumed_samples // active_total_samples``), so iterating again continues with the next
    epoch and a resumed run reproduces the same order. With ``data_sharding`` each DP rank shuffles
    its own contiguous bucket of the dataset; otherwise one global permutation is dealt round-robin.
    The trailing ``total_samples % (mbs*dp)`` samples are never used.

    Yields:
        lists of ``micro_batch_size`` sample indices.

    Raises:
        ValueError: an empty dataset, bad sizes/ranks, or ``consumed_samples`` not on a global
            micro-step boundary within its epoch.
    """

    def __init__(
        self,
        dataset: Any,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
    ) -> None:
        _check_common(total_samples, micro_batch_size, data_parallel_rank, data_parallel_size)
        self.dataset = dataset
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.last_batch_size = total_samples % self.micro_batch_times_data_parallel_size
        if total_samples - self.last_batch_size <= 0:
            raise ValueError(
                f"the dataset has {total_samples} samples, fewer than one global micro-step "
                f"({self.micro_batch_times_data_parallel_size} = micro batch x data-parallel size)"
            )
        self.epoch = 0

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[List[int]]:
        active_total_samples = self.total_samples - self.last_batch_size
        self.epoch = self.consumed_samples // active_total_samples
        current_epoch_samples = self.consumed_samples % active_total_samples
        if current_epoch_samples % self.micro_batch_times_data_parallel_size != 0:
            raise ValueError(
                f"consumed_samples {self.consumed_samples} is not a multiple of micro batch x data-parallel "
                f"size ({self.micro_batch_times_data_parallel_size}) within its epoch"
            )
        generator = torch.Generator()
        generator.manual_seed(self.epoch)
        if self.data_sharding:
            bucket_size = (self.total_samples // self.micro_batch_times_data_parallel_size) * self.micro_batch_size
            bucket_offset = current_epoch_samples // self.data_parallel_size
            start_idx = self.data_parallel_rank * bucket_size
            random_idx = torch.randperm(bucket_size, generator=generator).tolist()
            idx_range = [start_idx + x for x in random_idx[bucket_offset:]]
        else:
            full_bucket_size = (self.total_samples // self.micro_batch_size) * self.micro_batch_size
            permutation = torch.randperm(full_bucket_size, generator=generator).tolist()
            idx_range = permutation[current_epoch_samples:][self.data_parallel_rank :: self.data_parallel_size]

        batch: List[int] = []
        for idx in idx_range:
            batch.append(idx)
            if len(batch) == self.micro_batch_size:
                self.consumed_samples += self.micro_batch_times_data_parallel_size
                yield batch
                batch = []


def _ignore_signals_in_worker(signals: Sequence[int], worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: the worker ignores ``signals``.

    Launchers deliver a preemption signal to whole process groups (torchrun ``killpg``s each rank,
    SLURM's scancel signals every process), so loader workers get it too; dying of it would make the
    main process fail with "DataLoader worker ... killed by signal" before it reaches the iteration
    boundary where ``--exit-signal-handler`` saves. Workers still exit when the main process does
    (the loader shuts them down, and they watch their parent).
    """
    for sig in signals:
        signal.signal(sig, signal.SIG_IGN)


def build_pretraining_data_loader_from(
    dataset: Any,
    consumed_samples: int,
    *,
    dataloader_type: Optional[str],
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int,
    seed: int,
    data_sharding: bool = True,
    full_validation: bool = False,
    worker_ignored_signals: Sequence[int] = (),
) -> Any:
    """A ``torch.utils.data.DataLoader`` over ``dataset`` that starts after ``consumed_samples`` samples.

    Args:
        dataloader_type: ``single`` (default when None), ``cyclic``, or ``external`` (the dataset is
            returned unchanged: it already is a loader).
        micro_batch_size, data_parallel_rank, data_parallel_size: the sampler's batch layout.
        num_workers: loader worker processes; with workers they are persistent.
        seed: seeds the loader's own ``torch.Generator``, so building or iterating the loader never
            draws from the global torch RNG (checkpoints restore that RNG; a resumed run must match).
        data_sharding: per-rank buckets for ``cyclic``.
        full_validation: a valid-split dataset is read from its start, whatever ``consumed_samples``.
        worker_ignored_signals: signals the worker processes ignore (``--exit-signal`` under
            ``--exit-signal-handler``: the main process alone handles it, at an iteration boundary).

    Returns:
        the DataLoader (batches are dicts of stacked tensors), the dataset itself for ``external``,
        or None when ``dataset`` is None.

    Raises:
        ValueError: an unknown dataloader type (or sampler errors, see the samplers).
    """
    if dataset is None:
        return None
    split = getattr(dataset, "split", None) or getattr(dataset, "index_split", None)
    kind = dataloader_type or "single"

    if split == Split.valid and full_validation:
        batch_sampler = MegatronPretrainingSampler(
            len(dataset), 0, micro_batch_size, data_parallel_rank, data_parallel_size
        )
    elif kind == "single":
        batch_sampler = MegatronPretrainingSampler(
            len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size
        )
    elif kind == "cyclic":
        batch_sampler = MegatronPretrainingRandomSampler(
            dataset, len(dataset), consumed_samples, micro_batch_size, data_parallel_rank, data_parallel_size,
            data_sharding=data_sharding,
        )
    elif kind == "external":
        return dataset
    else:
        raise ValueError(f"--dataloader-type {kind!r} is not supported (choose single, cyclic or external)")

    generator = torch.Generator()
    generator.manual_seed(int(seed))
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=batch_sampler,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        persistent_workers=num_workers > 0,
        generator=generator,
        worker_init_fn=partial(_ignore_signals_in_worker, tuple(worker_ignored_signals)) if worker_ignored_signals else None,
    )


def build_pretraining_data_loader(dataset: Any, consumed_samples: int, micro_batch_size: Optional[int] = None) -> Any:
    """``build_pretraining_data_loader_from`` with the run's configuration (``get_config()``: Megatron's
    signature, so this entry point fetches it) and the DP rank/size of ``megatron.core.parallel_state``:
    ``--dataloader-type``, ``--micro-batch-size`` unless ``micro_batch_size`` is given (evaluation uses
    ``--eval-micro-batch-size``), ``--num-workers``, ``--seed``, data sharding, ``--full-validation``;
    workers ignore ``--exit-signal`` under ``--exit-signal-handler``.

    Returns:
        see ``build_pretraining_data_loader_from``; None when ``dataset`` is None.
    """
    if dataset is None:
        return None
    from megatron.core import parallel_state
    from megatron.training.global_vars import get_config

    cfg = get_config()
    data, train = cfg.data, cfg.train
    return build_pretraining_data_loader_from(
        dataset,
        consumed_samples,
        dataloader_type=data.dataloader_type,
        micro_batch_size=micro_batch_size if micro_batch_size is not None else train.micro_batch_size,
        data_parallel_rank=parallel_state.get_data_parallel_rank(),
        data_parallel_size=parallel_state.get_data_parallel_world_size(),
        num_workers=data.num_workers,
        seed=cfg.rng.seed,
        data_sharding=data.data_sharding,
        full_validation=cfg.validation.full_validation,
        worker_ignored_signals=(train.exit_signal,) if train.exit_signal_handler else (),
    )
