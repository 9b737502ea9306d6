"""Global batch size -> number of microbatches per iteration (process-wide singleton)."""
import logging
from typing import List, Optional

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: Optional["ConstantNumMicroBatchesCalculator"] = None


class ConstantNumMicroBatchesCalculator:
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
        for name, value in (("global batch size", global_batch_size), ("micro batch size", micro_batch_size),
                            ("data parallel size", data_parallel_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        micro_batch_times_data_parallel = micro_batch_size * data_parallel_size
        if global_batch_size % micro_batch_times_data_parallel != 0 and not decrease_batch_size_if_needed:
            raise ValueError(
                "global batch size ({}) is not divisible by micro batch size ({}) times data parallel "
                "size ({})".format(global_batch_size, micro_batch_size, data_parallel_size)
            )
        self.num_micro_batches = global_batch_size // micro_batch_times_data_parallel
        if self.num_micro_batches < 1:
            raise ValueError(
                f"number of microbatches should be at least 1, got {self.num_micro_batches} (global batch size "
                f"{global_batch_size} < micro batch size {micro_batch_size} x data parallel size {data_parallel_size})"
            )
        self.micro_batch_size = micro_batch_size
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = self.num_micro_batches * micro_batch_times_data_parallel
        if decrease_batch_size_if_needed and rank == 0 and \
                self.current_running_global_batch_size != global_batch_size:
            logger.info("decreasing the running global batch size from %d to %d to be divisible by micro "
                        "batch size x data parallel size", global_batch_size,
                        self.current_running_global_batch_size)

    def get(self) -> int:
        """Number of microbatches per iteration."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """The configured global batch size."""
        return self.current_global_batch_size

    def get_current_running_global_batch_size(self) -> int:
        """Samples actually consumed per iteration (differs only with decrease_batch_size_if_needed)."""
        return self.current_running_global_batch_size

    def get_micro_batch_size(self) -> int:
        """Samples per microbatch per rank."""
        return self.micro_batch_size

    def update(self, consumed_samples: int, consistency_check: bool = True, verbose: bool = False):
        """A constant schedule never changes."""


def _calculator() -> ConstantNumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError("num microbatches calculator is not initialized; call init_num_microbatches_calculator()")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    """Microbatches per iteration. Raises RuntimeError before initialisation."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """Configured global batch size. Raises RuntimeError before initialisation."""
    return _calculator().get_current_global_batch_size()


def get_current_running_global_batch_size() -> int:
    """Samples consumed per iteration. Raises RuntimeError before initialisation."""
    return _calculator().get_current_running_global_batch_size()


def get_micro_batch_size() -> int:
    """Micro batch size. Raises RuntimeError before initialisation."""
    return _calculator().get_micro_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False):
    """Let the calculator react to ``consumed_samples`` (a no-op for the constant schedule)."""
    _calculator().update(consumed_samples, consistency_check, verbose)


def init_num_microbatches_calculator(rank: int, rampup_batch_size: Optional[List[int]], global_batch_size: int,
                                     micro_batch_size: int, data_parallel_size: int,
                                     decrease_batch_size_if_needed: bool = False):
    """Create the process-wide calculator.

    ``rampup_batch_size`` (``--rampup-batch-size start incr samples``) is deprecated in Megatron-LM and
    has no effect: a warning is logged and the batch size stays constant.

    Raises:
        RuntimeError: the calculator is already initialised.
        ValueError: see :class:`ConstantNumMicroBatchesCalculator`.
    """
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise RuntimeError("num microbatches calculator is already initialized")
    if rampup_batch_size is not None and rank == 0:
        logger.warning("--rampup-batch-size is deprecated and has no effect; the global batch size stays %d",
                       global_batch_size)
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = ConstantNumMicroBatchesCalculator(
        global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed, rank
    )
    if rank == 0:
        logger.info("setting number of microbatches to constant %d", _GLOBAL_NUM_MICROBATCHES_CALCULATOR.get())


def destroy_num_microbatches_calculator():
    """Drop the calculator (tests and re-initialisation)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def unset_num_microbatches_calculator():
    """Alias of :func:`destroy_num_microbatches_calculator` (Megatron-LM name)."""
    destroy_num_microbatches_calculator()
