"""Global batch size -> number of microbatches per iteration, constant or ramped up (process-wide singleton)."""
import logging
from abc import ABC, abstractmethod
from typing import List, Optional, Sequence, Union

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional["NumMicroBatchesCalculator"] = None


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def _running_batch_size(global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                        decrease_batch_size_if_needed: bool, what: str = "global batch size") -> int:
    """The samples one iteration really consumes: ``global_batch_size`` itself, or with
    ``decrease_batch_size_if_needed`` rounded down to a multiple of mbs x dp.

    Raises ValueError when it is not a multiple (and rounding is off) or when no microbatch is left.
    """
    step = micro_batch_size * data_parallel_size
    if global_batch_size % step != 0 and not decrease_batch_size_if_needed:
        raise ValueError(
            "{} ({}) is not divisible by micro batch size ({}) times data parallel size ({})".format(
                what, global_batch_size, micro_batch_size, data_parallel_size)
        )
    running = global_batch_size // step * step
    if running < step:
        raise ValueError(
            f"number of microbatches should be at least 1, got {running // step} ({what} {global_batch_size} < "
            f"micro batch size {micro_batch_size} x data parallel size {data_parallel_size})"
        )
    return running


class NumMicroBatchesCalculator(ABC):
    """What both schedules answer: microbatches per iteration and the batch sizes behind them."""

    num_micro_batches: int
    micro_batch_size: int
    current_global_batch_size: int
    current_running_global_batch_size: int

    def get(self) -> int:
        """Number of microbatches per iteration."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """The global batch size the schedule asks for now (before any rounding down)."""
        return self.current_global_batch_size

    def get_current_running_global_batch_size(self) -> int:
        """Samples one iteration consumes now (differs from the above only with decrease_batch_size_if_needed)."""
        return self.current_running_global_batch_size

    def get_micro_batch_size(self) -> int:
        """Samples per microbatch per rank."""
        return self.micro_batch_size

    @abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        """Recompute the batch size for ``consumed_samples`` samples consumed so far."""


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """``num_microbatches = global_batch_size // (micro_batch_size * data_parallel_size)``.

    Args:
        global_batch_size: samples per iteration over all data-parallel ranks.
        micro_batch_size: samples per microbatch per rank.
        data_parallel_size: data-parallel ranks (context parallelism excluded).
        decrease_batch_size_if_needed: round the global batch down to a multiple of mbs x dp
            instead of failing.
        rank: global rank (logging only on rank 0).

    Raises:
        ValueError: the global batch is not a multiple of mbs x dp (and rounding is off), or there
            would be no microbatch at all, or a size is not positive.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool = False, rank: int = 0):
        _positive_int("global batch size", global_batch_size)
        _positive_int("micro batch size", micro_batch_size)
        _positive_int("data parallel size", data_parallel_size)
        running = _running_batch_size(global_batch_size, micro_batch_size, data_parallel_size,
                                      decrease_batch_size_if_needed)
        self.micro_batch_size = micro_batch_size
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // (micro_batch_size * data_parallel_size)
        if rank == 0 and running != global_batch_size:
            logger.info("decreasing the running global batch size from %d to %d to be divisible by micro "
                        "batch size x data parallel size", global_batch_size, running)

    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        """A constant schedule never changes."""


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Global batch size ramped up linearly over consumed samples (Megatron-LM's ``--rampup-batch-size``).

    The batch starts at ``start_global_batch_size`` and grows by ``batch_size_increment`` every
    ``rampup_samples / ((global_batch_size - start_global_batch_size) / batch_size_increment)``
    consumed samples; once more than ``rampup_samples`` samples are consumed it stays at
    ``global_batch_size``. Example: start 16, increment 8, global 32, ramp-up 100 samples -> 2
    increments, one per 50 samples: 16 for consumed samples in [0, 50), 24 in [50, 100), 32 after.
    The batch of an iteration is decided by the samples consumed *before* it, so a resumed run
    (which restores the consumed samples) continues on the same schedule.

    Args:
        global_batch_size: the batch size at the end of the ramp.
        micro_batch_size, data_parallel_size: as for the constant schedule.
        decrease_batch_size_if_needed: round each batch of the ramp down to a multiple of mbs x dp.
        rank: global rank (logging only on rank 0).
        start_global_batch_size: the first batch size.
        batch_size_increment: the step between two batch sizes.
        rampup_samples: consumed samples over which the ramp runs.

    Raises:
        ValueError (naming ``--rampup-batch-size``): a non-positive size or increment, negative
            ramp-up samples, a start above the global batch, a difference that is not a whole
            number of increments, or a batch of the ramp that is not a multiple of mbs x dp (and
            rounding is off) or is smaller than one microbatch per data-parallel rank.
    """

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int, start_global_batch_size: int,
                 batch_size_increment: int, rampup_samples: int):
        _positive_int("global batch size", global_batch_size)
        _positive_int("micro batch size", micro_batch_size)
        _positive_int("data parallel size", data_parallel_size)
        _positive_int("--rampup-batch-size start batch size", start_global_batch_size)
        _positive_int("--rampup-batch-size batch size increment", batch_size_increment)
        if isinstance(rampup_samples, bool) or not isinstance(rampup_samples, int) or rampup_samples < 0:
            raise ValueError(f"--rampup-batch-size ramp-up samples must be a non-negative integer, got "
                             f"{rampup_samples!r}")
        diff = global_batch_size - start_global_batch_size
        if diff < 0:
            raise ValueError(f"--rampup-batch-size start batch size ({start_global_batch_size}) must not exceed "
                             f"the global batch size ({global_batch_size}, --global-batch-size)")
        if diff % batch_size_increment != 0:
            raise ValueError(f"--rampup-batch-size: the difference between the global batch size "
                             f"({global_batch_size}) and the start batch size ({start_global_batch_size}) is "
                             f"{diff}, not a multiple of the increment ({batch_size_increment})")
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.rampup_samples = rampup_samples
        num_increments = diff // batch_size_increment
        # With nothing to ramp the schedule is constant from the start.
        self.rampup_samples_per_increment = rampup_samples / num_increments if num_increments else None
        # Every batch of the ramp is checked now: a bad one fails at start-up, not hours into a run.
        for batch in self.batch_sizes():
            _running_batch_size(batch, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed,
                                what="--rampup-batch-size: global batch size")
        self.current_global_batch_size = None
        self.update(0, consistency_check=False, verbose=True)

    def batch_sizes(self) -> List[int]:
        """Every global batch size of the ramp, from the start one to the final one."""
        return list(range(self.start_global_batch_size, self.global_batch_size + 1, self.batch_size_increment))

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The (unrounded) global batch size of the iteration that starts after ``consumed_samples``."""
        if self.rampup_samples_per_increment is None or consumed_samples > self.rampup_samples:
            return self.global_batch_size
        # Megatron-LM's float arithmetic, so both frameworks switch batch size at the same iteration.
        steps = int(consumed_samples / self.rampup_samples_per_increment)
        return min(self.start_global_batch_size + steps * self.batch_size_increment, self.global_batch_size)

    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
        """Set the batch size and number of microbatches for ``consumed_samples``.

        ``consistency_check`` is kept for Megatron-LM's signature: every batch of the ramp was
        already checked against mbs x dp at construction. ``verbose`` logs a change of batch size at
        INFO on rank 0.
        """
        old = self.current_global_batch_size
        self.current_global_batch_size = self.global_batch_size_at(consumed_samples)
        self.current_running_global_batch_size = _running_batch_size(
            self.current_global_batch_size, self.micro_batch_size, self.data_parallel_size,
            self.decrease_batch_size_if_needed, what="--rampup-batch-size: current global batch size")
        self.num_micro_batches = self.current_running_global_batch_size // (
            self.micro_batch_size * self.data_parallel_size)
        if verbose and self.rank == 0 and old != self.current_global_batch_size:
            if old is None:
                logger.info("setting initial batch size to %d", self.current_global_batch_size)
            else:
                logger.info("ramping up batch size from %d to %d", old, self.current_global_batch_size)
            if self.current_running_global_batch_size != self.current_global_batch_size:
                logger.info("decreasing the running global batch size from %d to %d to be divisible by micro "
                            "batch size x data parallel size", self.current_global_batch_size,
                            self.current_running_global_batch_size)


def _calculator() -> NumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError("num microbatches calculator is not initialized; call init_num_microbatches_calculator()")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    """Microbatches per iteration. Raises RuntimeError before initialisation."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """Global batch size the schedule asks for now. Raises RuntimeError before initialisation."""
    return _calculator().get_current_global_batch_size()


def get_current_running_global_batch_size() -> int:
    """Samples consumed per iteration now. Raises RuntimeError before initialisation."""
    return _calculator().get_current_running_global_batch_size()


def get_micro_batch_size() -> int:
    """Micro batch size. Raises RuntimeError before initialisation."""
    return _calculator().get_micro_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False):
    """Let the calculator follow ``consumed_samples`` (a no-op for the constant schedule)."""
    _calculator().update(consumed_samples, consistency_check, verbose)


def parse_rampup_batch_size(rampup_batch_size: Sequence[Union[str, int]]) -> List[int]:
    """``--rampup-batch-size`` values -> ``[start, increment, ramp-up samples]`` as integers.

    Raises ValueError naming the flag unless there are exactly three integers.
    """
    usage = "--rampup-batch-size <start batch size> <batch size increment> <ramp-up samples>"
    if len(rampup_batch_size) != 3:
        raise ValueError(f"expected {usage}, got {len(rampup_batch_size)} value(s): {list(rampup_batch_size)}")
    try:
        return [int(value) for value in rampup_batch_size]
    except (TypeError, ValueError):
        raise ValueError(f"expected {usage} as integers, got {list(rampup_batch_size)}") from None


def build_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[Sequence], global_batch_size: int,
                                      micro_batch_size: int, data_parallel_size: int,
                                      decrease_batch_size_if_needed: bool = False) -> NumMicroBatchesCalculator:
    """A constant calculator, or the ramp-up one when ``rampup_batch_size`` (start, increment, samples) is given.

    Raises ValueError: see the two calculators and :func:`parse_rampup_batch_size`.
    """
    if rampup_batch_size is None:
        calculator = ConstantNumMicroBatchesCalculator(
            global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank)
        if rank == 0:
            logger.info("setting number of microbatches to constant %d", calculator.get())
        return calculator
    start, increment, samples = parse_rampup_batch_size(rampup_batch_size)
    if rank == 0:
        logger.info("will use batch size rampup starting from global batch size %d to global batch size %d with "
                    "batch size increments %d over %d samples.", start, global_batch_size, increment, samples)
    return RampupBatchsizeNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank,
        start, increment, samples)


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]], global_batch_size: int,
                                     micro_batch_size: int, data_parallel_size: int,
                                     decrease_batch_size_if_needed: bool = False):
    """Create the process-wide calculator (see :func:`build_num_microbatches_calculator`).

    Raises:
        RuntimeError: the calculator is already initialised.
        ValueError: bad sizes or ramp-up values.
    """
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise RuntimeError("num microbatches calculator is already initialized")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed)


def reconfigure_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]],
                                            global_batch_size: int, micro_batch_size: int,
                                            data_parallel_size: int, decrease_batch_size_if_needed: bool = False):
    """Replace the process-wide calculator (Megatron-LM name; evaluation and tools use it)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed)


def destroy_num_microbatches_calculator():
    """Drop the calculator (tests and re-initialisation)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def unset_num_microbatches_calculator():
    """Alias of :func:`destroy_num_microbatches_calculator` (Megatron-LM name)."""
    destroy_num_microbatches_calculator()
