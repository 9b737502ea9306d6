"""Configuration of the data-parallel wrapper (grad buffer dtype, bucketing, overlap, NaN checks)."""
from dataclasses import dataclass
from typing import Optional


@dataclass
class DistributedDataParallelConfig:
    """Options of :class:`DistributedDataParallel`; names and defaults follow Megatron-LM.

    Attributes:
        grad_reduce_in_fp32: keep the grad buffer (``param.main_grad``) in fp32 and all-reduce in fp32
            (``--accumulate-allreduce-grads-in-fp32``).
        overlap_grad_reduce: launch each bucket's all-reduce asynchronously as soon as all of its grads
            are ready during the last microbatch's backward (``--overlap-grad-reduce``).
        overlap_param_gather: all-gather the updated params bucket by bucket in forward pre-hooks of the
            next forward instead of at the end of the optimizer step (needs the distributed optimizer
            and ``overlap_grad_reduce``; ``--overlap-param-gather``).
        use_distributed_optimizer: lay the buffers out for a sharded optimizer (param starts padded to
            64 elements, bucket ends to lcm(dp, 128)), add a param buffer, reduce-scatter the grads
            (``--use-distributed-optimizer``).
        check_for_nan_in_grad: record each bucket's local grad norm before its collective (on the
            device, no host read) and raise RuntimeError naming the rank if one is NaN/Inf: in
            ``finish_grad_sync`` (one read per step for all buckets), or when the caller calls
            ``check_for_nan_in_grad`` itself (``defer_nan_check``; the training loop does so only when
            the clipped grad norm is not finite, before the optimizer step). The norms are dropped once
            the check is decided (``discard_local_grad_norms``), so none outlives its step.
        bucket_size: elements per bucket; None -> max(40e6, 1e6 * dp) when overlapping, else one bucket.
        average_in_collective: reduce with AVG instead of pre-scaling by 1/dp and SUM
            (``--ddp-average-in-collective``).
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    check_for_nan_in_grad: bool = False
    bucket_size: Optional[int] = None
    average_in_collective: bool = False

    def __post_init__(self):
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"--ddp-bucket-size must be positive, got {self.bucket_size}")
        if self.overlap_param_gather and not (self.use_distributed_optimizer and self.overlap_grad_reduce):
            raise ValueError(
                "--overlap-param-gather requires --use-distributed-optimizer and --overlap-grad-reduce"
            )
