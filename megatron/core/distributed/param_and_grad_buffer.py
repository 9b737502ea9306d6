"""Contiguous param and grad buffers, their buckets, and the per-bucket data-parallel collectives."""
import logging
import math
from typing import Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from megatron.core import progress

from .distributed_data_parallel_config import DistributedDataParallelConfig

logger = logging.getLogger(__name__)

# With the distributed optimizer every param starts on a 64-element boundary so that shard
# boundaries fall on aligned addresses (Megatron-LM layout).
_PARAM_START_ALIGNMENT = 64
_BUCKET_END_ALIGNMENT = 128


class _ParamAndGradBucket:
    """One bucket: a contiguous slice of a grad buffer covering whole params.

    Attributes:
        params: the params whose ``main_grad`` lives in this bucket (buffer order).
        param_data: 1-D view of the param buffer slice, ``[numel]``, or None (no param buffer).
        grad_data: 1-D view of the buffer slice, ``[numel]`` (padding included).
        offset: index of ``grad_data[0]`` in the buffer.
        numel_unpadded: elements actually used by params.
        gradient_scaling_factor: multiplier applied to ``grad_data`` before the collective.
        bucket_id: position of the bucket in its buffer.
    """

    def __init__(self, params: List[torch.nn.Parameter], param_data: Optional[torch.Tensor],
                 grad_data: torch.Tensor, offset: int, numel_unpadded: int, gradient_scaling_factor: float,
                 bucket_id: int):
        self.params = params
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset
        self.numel_unpadded = numel_unpadded
        self.gradient_scaling_factor = gradient_scaling_factor
        self.bucket_id = bucket_id


def shard_buffer(buffer: torch.Tensor, data_parallel_world_size: int) -> List[torch.Tensor]:
    """``data_parallel_world_size`` equal contiguous views of the 1-D ``buffer`` (rank r owns the r-th).

    Raises:
        ValueError: ``buffer.numel()`` is not divisible by the world size (the distributed optimizer
            pads every bucket so that it is).
    """
    if buffer.numel() % data_parallel_world_size != 0:
        raise ValueError(f"bucket of {buffer.numel()} elements cannot be split evenly over "
                         f"{data_parallel_world_size} data-parallel ranks")
    shard = buffer.numel() // data_parallel_world_size
    return [buffer[r * shard:(r + 1) * shard] for r in range(data_parallel_world_size)]


def _collective(name: str):
    # torch >= 2.10 renamed the tensor variants (``*_single``); the old names still work but warn.
    return getattr(dist, {"reduce_scatter_tensor": "reduce_scatter_single",
                          "all_gather_into_tensor": "all_gather_single"}[name], None) or getattr(dist, name)


def _host_backend(group) -> bool:
    """True for gloo/mpi groups, whose collectives may not write into a view of their own input."""
    return dist.get_backend(group) in ("gloo", "mpi")


class _ParamAndGradBucketGroup:
    """Buckets whose grads are reduced together, plus the state of their (possibly async) collectives.

    Each bucket of a buffer forms its own group. With ``overlap_grad_reduce`` the reduction is
    launched asynchronously by :meth:`register_grad_ready` once every param of the group has its
    grad for the last microbatch, and awaited in :meth:`finish_grad_sync`.

    Without the distributed optimizer the reduction is an all-reduce of each bucket. With it
    (ZeRO stage 1/2 style sharding, Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
    Trillion Parameter Models", SC 2020, section 5) it is a reduce-scatter: afterwards only this
    rank's shard of each bucket (``shard_buffer(grad_data, dp)[dp_rank]``) holds the reduced grad.
    The updated params are then all-gathered shard by shard into ``param_data``
    (:meth:`start_param_sync` / :meth:`finish_param_sync`); with ``overlap_param_gather`` that
    all-gather runs asynchronously and is awaited by a forward pre-hook, which also dispatches the
    gather of the next group in forward order (``next_param_gather_bucket_group``).

    Args:
        buckets: the buckets of this group.
        ddp_config: the wrapper's options.
        collective_group: process group of the reduction (data-parallel with context-parallel).
        collective_group_size: number of ranks in ``collective_group``.
    """

    def __init__(self, buckets: List[_ParamAndGradBucket], ddp_config: DistributedDataParallelConfig,
                 collective_group, collective_group_size: int):
        self.buckets = buckets
        self.ddp_config = ddp_config
        self.intra_distributed_optimizer_instance_group = collective_group
        self.intra_distributed_optimizer_instance_size = collective_group_size
        self.params: Set[torch.nn.Parameter] = set()
        for bucket in buckets:
            self.params.update(bucket.params)
        self.params_with_grad: Set[torch.nn.Parameter] = set()
        # True outside no_sync(): only then does a ready grad count towards launching the collective.
        self.is_last_microbatch = True
        self.grad_reduce_handle: Optional[list] = None
        self._sync_launched = False
        self.local_grad_norms: Optional[torch.Tensor] = None
        self._reduce_op, self._post_scale = self._choose_reduce_op()
        self._copy_after_collective: List[Tuple[torch.Tensor, torch.Tensor]] = []
        if ddp_config.use_distributed_optimizer:
            self.data_parallel_rank = dist.get_rank(collective_group)
        # Param all-gather state (distributed optimizer only): ``params_stale`` is True between the
        # optimizer step that updated this rank's shard and the all-gather that spreads it.
        self.params_stale = False
        self.param_gather_handle: Optional[list] = None
        self.next_param_gather_bucket_group: Optional["_ParamAndGradBucketGroup"] = None

    def _choose_reduce_op(self) -> Tuple[object, float]:
        """(reduce op, factor applied after the collective); AVG is emulated where unsupported."""
        if not self.ddp_config.average_in_collective:
            return dist.ReduceOp.SUM, 1.0
        # gloo has no AVG; SUM followed by 1/n gives the same mean.
        if dist.get_backend(self.intra_distributed_optimizer_instance_group) == "nccl":
            return dist.ReduceOp.AVG, 1.0
        return dist.ReduceOp.SUM, 1.0 / self.intra_distributed_optimizer_instance_size

    def reset(self):
        """Forget ready grads and pending collectives (called when the grad buffer is zeroed)."""
        self.params_with_grad.clear()
        self.is_last_microbatch = True
        self.grad_reduce_handle = None
        self._sync_launched = False
        self.local_grad_norms: Optional[torch.Tensor] = None

    def record_local_grad_norms(self):
        """Keep each bucket's local grad norm [num_buckets] (fp32, on the grads' device), taken before
        the collective mixes in other ranks' grads. Nothing is read here (this runs inside backward
        with ``overlap_grad_reduce``): ``DistributedDataParallel.check_for_nan_in_grad`` reads the
        norms of all buckets at once, one host read per step."""
        self.local_grad_norms = torch.stack([
            torch.linalg.vector_norm(bucket.grad_data, dtype=torch.float32) for bucket in self.buckets])

    def start_grad_sync(self):
        """Scale the buckets' grads and launch their all-reduce (async when overlapping).

        Raises:
            RuntimeError: the collective of this group was already launched since the last reset.
        """
        if self._sync_launched:
            raise RuntimeError("grad sync of this bucket group was already started; call zero_grad_buffer() first")
        if self.ddp_config.check_for_nan_in_grad:
            self.record_local_grad_norms()
        for bucket in self.buckets:
            if bucket.gradient_scaling_factor != 1.0:
                bucket.grad_data.mul_(bucket.gradient_scaling_factor)
        async_op = self.ddp_config.overlap_grad_reduce
        group = self.intra_distributed_optimizer_instance_group
        handles = []
        self._copy_after_collective = []
        for bucket in self.buckets:
            if self.ddp_config.use_distributed_optimizer:
                local = shard_buffer(bucket.grad_data, self.intra_distributed_optimizer_instance_size)[
                    self.data_parallel_rank]
                # NCCL reduces in place into a view of its input; host backends get a separate output.
                output = torch.empty_like(local) if _host_backend(group) else local
                if output is not local:
                    self._copy_after_collective.append((local, output))
                handle = _collective("reduce_scatter_tensor")(
                    output, bucket.grad_data, op=self._reduce_op, group=group, async_op=async_op)
            else:
                handle = dist.all_reduce(bucket.grad_data, op=self._reduce_op, group=group, async_op=async_op)
            if async_op:
                handles.append(handle)
        self.grad_reduce_handle = handles if async_op else None
        self._sync_launched = True
        if not async_op:
            self._after_grad_collective()

    def _after_grad_collective(self):
        for local, output in self._copy_after_collective:
            local.copy_(output)
        self._copy_after_collective = []
        if self._post_scale != 1.0:
            for bucket in self.buckets:
                bucket.grad_data.mul_(self._post_scale)

    def finish_grad_sync(self):
        """Complete this group's all-reduce; launch it first (synchronously) when not overlapping.

        Raises:
            RuntimeError: with ``overlap_grad_reduce``, the collective was never launched because some
                params of the bucket did not receive a grad in the last microbatch's backward.
        """
        if not self._sync_launched:
            if self.ddp_config.overlap_grad_reduce:
                raise RuntimeError(
                    "communication call has not been issued for this bucket "
                    f"({len(self.params_with_grad)}/{len(self.params)} params have grad available); "
                    "every trainable param must get a grad in the last microbatch with --overlap-grad-reduce"
                )
            self.start_grad_sync()
        if self.grad_reduce_handle is not None:
            progress.PROGRESS.comm = ("grad reduce (overlapped)", self.intra_distributed_optimizer_instance_group)
            for handle in self.grad_reduce_handle:
                handle.wait()
            progress.PROGRESS.comm = None
            self.grad_reduce_handle = None
            self._after_grad_collective()
        # A later microbatch cycle may launch again only after zero_grad_buffer(); keep launched=True.

    def register_grad_ready(self, param: torch.nn.Parameter):
        """Mark ``param``'s grad as final; launch the collective when the whole group is ready.

        Only counts during the last microbatch (outside ``no_sync``) with ``overlap_grad_reduce``.

        Raises:
            RuntimeError: the same param reports a ready grad twice in one backward.
        """
        if not (self.ddp_config.overlap_grad_reduce and self.is_last_microbatch):
            return
        if param in self.params_with_grad:
            raise RuntimeError("cannot set grad twice: a param reported a ready grad twice in one iteration")
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    def start_param_sync(self, force_sync: bool = False):
        """All-gather every bucket's param shards into ``param_data`` (distributed optimizer only).

        Asynchronous with ``overlap_param_gather`` unless ``force_sync``; a gather already in flight is
        simply completed when ``force_sync``. Does nothing when the params are not stale.

        Raises:
            RuntimeError: called without the distributed optimizer.
        """
        if not self.ddp_config.use_distributed_optimizer:
            raise RuntimeError("start_param_sync needs the distributed optimizer (--use-distributed-optimizer)")
        if self.param_gather_handle is not None:
            if force_sync:
                self._wait_param_gather()
            return
        if not self.params_stale:
            return
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        group = self.intra_distributed_optimizer_instance_group
        handles = []
        for bucket in self.buckets:
            local = shard_buffer(bucket.param_data, self.intra_distributed_optimizer_instance_size)[
                self.data_parallel_rank]
            # Host backends read the input while writing the output: give them a private input.
            source = local.clone() if _host_backend(group) else local
            handle = _collective("all_gather_into_tensor")(bucket.param_data, source, group=group, async_op=async_op)
            if async_op:
                handles.append(handle)
        if async_op:
            self.param_gather_handle = handles
        else:
            self.params_stale = False

    def all_gather_grads(self):
        """All-gather the reduced grad shards so every rank holds the whole reduced ``grad_data``.

        Only needed with the distributed optimizer when a grad is reduced once more over another
        group whose ranks shard it differently (the tied embedding across pipeline stages).
        A synchronous collective over the data-parallel group.
        """
        group = self.intra_distributed_optimizer_instance_group
        for bucket in self.buckets:
            local = shard_buffer(bucket.grad_data, self.intra_distributed_optimizer_instance_size)[
                self.data_parallel_rank]
            _collective("all_gather_into_tensor")(bucket.grad_data, local.clone(), group=group)

    def _wait_param_gather(self):
        progress.PROGRESS.comm = ("param all-gather (overlapped)", self.intra_distributed_optimizer_instance_group)
        for handle in self.param_gather_handle:
            handle.wait()
        progress.PROGRESS.comm = None
        self.param_gather_handle = None
        self.params_stale = False

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False):
        """Make this group's params current (forward pre-hook with ``overlap_param_gather``).

        Dispatches the gather if it was not yet, waits for it, then dispatches the asynchronous
        gather of ``next_param_gather_bucket_group`` so that it overlaps the forward of this group.
        """
        if self.param_gather_handle is None and self.params_stale:
            self.start_param_sync()
        if self.param_gather_handle is not None:
            self._wait_param_gather()
            following = self.next_param_gather_bucket_group
            if following is not None and not skip_next_bucket_dispatch:
                following.start_param_sync()


def _pad(value: int, multiple: int) -> int:
    return int(math.ceil(value / multiple)) * multiple


class _ParamAndGradBuffer:
    """A contiguous grad buffer for params of one (param dtype, grad dtype) pair, split into buckets.

    Params are laid out in **reverse** order (the order in which backward produces their grads),
    and a bucket closes as soon as it holds at least ``bucket_size`` elements (Megatron-LM layout).
    Each param gets ``param.main_grad``, a view of shape ``param.shape`` into ``grad_data``.
    With the distributed optimizer a param buffer ``param_data`` of the same layout (dtype
    ``param_dtype``) is created too and every ``param.data`` becomes a view into it, so that the
    updated shards can be all-gathered straight into the model; each param then starts on a
    64-element boundary and each bucket is padded to a multiple of lcm(dp, 128) elements so that
    it splits evenly into dp shards.

    Args:
        ddp_config: the wrapper's options (padding is applied only with ``use_distributed_optimizer``).
        param_dtype: dtype of the params.
        grad_dtype: dtype of ``grad_data`` / ``main_grad``.
        params: the params in module order.
        data_parallel_group: group the grads are reduced over.
        bucket_size: elements per bucket, or None for a single bucket.
        param_to_name: names used in debug logging.
        gradient_scaling_factor: multiplier applied before the collective (1/dp or 1.0).
        data_parallel_world_size: size of ``data_parallel_group``.
    """

    def __init__(self, ddp_config: DistributedDataParallelConfig, param_dtype: torch.dtype,
                 grad_dtype: torch.dtype, params: List[torch.nn.Parameter], data_parallel_group,
                 bucket_size: Optional[int], param_to_name: Dict[torch.nn.Parameter, str],
                 gradient_scaling_factor: float, data_parallel_world_size: int):
        if not params:
            raise ValueError("a grad buffer needs at least one param")
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.params = params
        self.data_parallel_group = data_parallel_group
        self.data_parallel_world_size = data_parallel_world_size
        self.gradient_scaling_factor = gradient_scaling_factor
        self.param_index_map: Dict[torch.nn.Parameter, Tuple[int, int, int]] = {}
        pad = ddp_config.use_distributed_optimizer
        bucket_end_multiple = math.lcm(data_parallel_world_size, _BUCKET_END_ALIGNMENT)

        bucket_ranges: List[Tuple[int, int, int, List[torch.nn.Parameter]]] = []
        index = 0
        bucket_start = 0
        bucket_params: List[torch.nn.Parameter] = []

        def close_bucket(end_unpadded: int) -> int:
            end = _pad(end_unpadded, bucket_end_multiple) if pad else end_unpadded
            bucket_ranges.append((bucket_start, end, end_unpadded - bucket_start, list(bucket_params)))
            bucket_params.clear()
            return end

        for param in reversed(params):
            start = _pad(index, _PARAM_START_ALIGNMENT) if pad else index
            end = start + param.numel()
            self.param_index_map[param] = (start, end, len(bucket_ranges))
            bucket_params.append(param)
            index = end
            if bucket_size is not None and end - bucket_start >= bucket_size:
                index = close_bucket(end)
                bucket_start = index
        if bucket_params:
            index = close_bucket(index)
        self.numel = index
        self.numel_unpadded = sum(p.numel() for p in params)

        device = params[0].device
        self.param_data: Optional[torch.Tensor] = None
        if ddp_config.use_distributed_optimizer:
            self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        for param in params:
            start, end, _ = self.param_index_map[param]
            if self.param_data is not None:
                # Move the values into the buffer, then make the param a view of them.
                self.param_data[start:end].view(param.shape).copy_(param.data)
                param.data = self.param_data[start:end].view(param.shape)
            param.main_grad = self.grad_data[start:end].view(param.shape)

        self.buckets: List[_ParamAndGradBucket] = []
        self.param_to_bucket: Dict[torch.nn.Parameter, _ParamAndGradBucket] = {}
        for bucket_id, (start, end, numel_unpadded, bparams) in enumerate(bucket_ranges):
            param_data = None if self.param_data is None else self.param_data[start:end]
            bucket = _ParamAndGradBucket(
                bparams, param_data, self.grad_data[start:end], start, numel_unpadded, gradient_scaling_factor,
                bucket_id,
            )
            self.buckets.append(bucket)
            for p in bparams:
                self.param_to_bucket[p] = bucket

        if logger.isEnabledFor(logging.DEBUG):
            for bucket in self.buckets:
                names = [param_to_name.get(p, "?") for p in bucket.params]
                logger.debug("grad buffer %s/%s bucket %d (%d elements): %s", param_dtype, grad_dtype,
                             bucket.bucket_id, bucket.grad_data.numel(), names)

    def scale_gradients(self, scaling_factor: float):
        """Multiply every grad in the buffer by ``scaling_factor``."""
        self.grad_data.mul_(scaling_factor)

    def reset(self):
        """Zero the whole grad buffer."""
        self.grad_data.zero_()


def partition_buckets(buffers: List[_ParamAndGradBuffer]) -> List[_ParamAndGradBucketGroup]:
    """One bucket group per bucket, in buffer order then bucket order (the order of their collectives).

    Buckets hold params in reverse order, so the forward pass meets the groups last to first: each
    group's ``next_param_gather_bucket_group`` is the one before it.
    """
    groups = []
    for buffer in buffers:
        for bucket in buffer.buckets:
            groups.append(_ParamAndGradBucketGroup(
                [bucket], buffer.ddp_config, buffer.data_parallel_group, buffer.data_parallel_world_size
            ))
    for index in range(1, len(groups)):
        groups[index].next_param_gather_bucket_group = groups[index - 1]
    return groups
