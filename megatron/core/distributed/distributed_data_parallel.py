"""Data-parallel wrapper: contiguous param/grad buffers (``param.main_grad``), bucketed grad reduction, param gather."""
import math
from contextlib import contextmanager
from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from megatron.core.telemetry import managed_span

from .distributed_data_parallel_config import DistributedDataParallelConfig
from .param_and_grad_buffer import _ParamAndGradBuffer, partition_buckets


class DistributedDataParallel(torch.nn.Module):
    """Wrap ``module`` so that its grads accumulate in fp32-capable buffers and are reduced over data-parallel ranks.

    Every trainable param gets ``param.main_grad`` (a view into a contiguous buffer grouped by
    (param dtype, grad dtype)); a post-accumulate-grad hook adds ``param.grad`` into it and frees
    ``param.grad``. :meth:`finish_grad_sync` all-reduces each bucket over the data-parallel group
    with context parallelism (grads pre-scaled by 1/dp and summed, or averaged in the collective).
    Expert parameters (``allreduce = False``, set on MoE expert linears) live in their own buffers
    (``expert_parallel_buffers`` / ``expert_parallel_bucket_groups``) reduced over the expert-data-parallel group
    (``parallel_state.get_expert_data_parallel_group``), pre-scaled by 1/dp, or by expert_dp/dp when averaged in
    the collective, so that they too end up divided by the data-parallel x context-parallel size (Megatron-LM).

    With ``use_distributed_optimizer`` the params also live in a contiguous buffer
    (``param.data`` is a view into it), the reduction is a reduce-scatter, and the distributed
    optimizer all-gathers the updated shards through :meth:`start_param_sync`. With
    ``overlap_param_gather`` that gather is asynchronous: forward pre-hooks on every module that
    owns params wait for their bucket's gather and dispatch the next one.

    Args:
        config: the model's ModelParallelConfig (``calculate_per_token_loss`` disables the 1/dp scale).
        ddp_config: buffer / bucketing / overlap options.
        module: the model to wrap; its state-dict keys are exposed unchanged (no ``module.`` prefix).
        disable_bucketing: force a single bucket per buffer.

    Raises:
        ValueError: ``average_in_collective`` combined with ``calculate_per_token_loss``, or no
            trainable params.
    """

    def __init__(self, config, ddp_config: DistributedDataParallelConfig, module: torch.nn.Module,
                 disable_bucketing: bool = False):
        super().__init__()
        from megatron.core import parallel_state

        self.config = config
        self.ddp_config = ddp_config
        self.module = module
        calculate_per_token_loss = getattr(config, "calculate_per_token_loss", False)
        if calculate_per_token_loss and ddp_config.average_in_collective:
            raise ValueError("--ddp-average-in-collective cannot be combined with --calculate-per-token-loss")

        self.data_parallel_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        dp_size = parallel_state.get_data_parallel_world_size(with_context_parallel=True)

        bucket_size = ddp_config.bucket_size
        if bucket_size is None:
            bucket_size = max(40_000_000, 1_000_000 * dp_size)
        # Without overlap there is nothing to gain from several collectives; later pipeline stages
        # finish backward last, so they also use one bucket (Megatron-LM behaviour).
        if not ddp_config.overlap_grad_reduce or disable_bucketing or not parallel_state.is_pipeline_first_stage():
            bucket_size = None
        self.bucket_size = bucket_size

        # Expert parameters (``allreduce = False``, Megatron's marker) differ across the expert-parallel ranks, so
        # their grads are reduced over the expert-data-parallel group only, in buffers of their own. Megatron's
        # scaling (DistributedDataParallel.__init__): every grad ends up divided by the DP x CP size, so expert
        # grads are pre-scaled by 1/dp (summed over expert-DP), or by expert_dp/dp before an averaging collective.
        if calculate_per_token_loss:
            gradient_scaling_factor = expert_gradient_scaling_factor = 1.0
        elif ddp_config.average_in_collective:
            gradient_scaling_factor = 1.0
            expert_gradient_scaling_factor = None  # expert_dp / dp, once the expert group is known
        else:
            gradient_scaling_factor = expert_gradient_scaling_factor = 1.0 / dp_size

        param_to_name: Dict[torch.nn.Parameter, str] = {}
        params_by_dtype: Dict[Tuple[torch.dtype, torch.dtype], List[torch.nn.Parameter]] = {}
        expert_params_by_dtype: Dict[Tuple[torch.dtype, torch.dtype], List[torch.nn.Parameter]] = {}
        for name, param in module.named_parameters():
            if not param.requires_grad:
                continue
            param.grad_added_to_main_grad = False
            if not hasattr(param, "zero_out_wgrad"):
                param.zero_out_wgrad = False
            param_to_name[param] = name
            grad_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else param.dtype
            by_dtype = params_by_dtype if getattr(param, "allreduce", True) else expert_params_by_dtype
            by_dtype.setdefault((param.dtype, grad_dtype), []).append(param)
        if not param_to_name:
            raise ValueError(f"DistributedDataParallel: {type(module).__name__} has no trainable params")

        self.buffers = [
            _ParamAndGradBuffer(ddp_config, param_dtype, grad_dtype, params, self.data_parallel_group,
                                bucket_size, param_to_name, gradient_scaling_factor, dp_size)
            for (param_dtype, grad_dtype), params in params_by_dtype.items()
        ]
        self.bucket_groups = partition_buckets(self.buffers)
        self.expert_data_parallel_group = None
        self.expert_parallel_buffers = []
        if expert_params_by_dtype:
            self.expert_data_parallel_group = parallel_state.get_expert_data_parallel_group()
            expert_dp_size = dist.get_world_size(self.expert_data_parallel_group)
            if expert_gradient_scaling_factor is None:
                expert_gradient_scaling_factor = expert_dp_size / dp_size
            self.expert_parallel_buffers = [
                _ParamAndGradBuffer(ddp_config, param_dtype, grad_dtype, params, self.expert_data_parallel_group,
                                    bucket_size, param_to_name, expert_gradient_scaling_factor, expert_dp_size)
                for (param_dtype, grad_dtype), params in expert_params_by_dtype.items()
            ]
        self.expert_parallel_bucket_groups = partition_buckets(self.expert_parallel_buffers)
        self.param_to_bucket_group = {p: group for group in self.all_bucket_groups() for p in group.params}
        self._grad_hook_handles = [
            param.register_post_accumulate_grad_hook(self._make_backward_post_hook())
            for param in param_to_name
        ]
        self._forward_pre_hook_handles = {}
        if ddp_config.overlap_param_gather:
            self.enable_forward_pre_hook()
        # With check_for_nan_in_grad, finish_grad_sync reads the local grad norms (one host read per
        # step) unless the caller takes that over (the training loop: only when the optimizer's
        # global grad norm, already on the host, is not finite).
        self.defer_nan_check = False

    def all_buffers(self):
        """The dense buffers, then the expert-parallel ones (Megatron's ``buffers + expert_parallel_buffers``)."""
        return self.buffers + self.expert_parallel_buffers

    def all_bucket_groups(self):
        """The dense bucket groups, then the expert-parallel ones, in the order of their collectives."""
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def enable_forward_pre_hook(self):
        """Wait for (and chain) the param all-gathers in forward pre-hooks (``overlap_param_gather``)."""
        if not self.ddp_config.overlap_param_gather:
            raise RuntimeError("forward pre-hooks gather params only with --overlap-param-gather")
        if self._forward_pre_hook_handles:
            return
        for module in self.module.modules():
            if any(p in self.param_to_bucket_group for p in module.parameters(recurse=False)):
                self._forward_pre_hook_handles[module] = module.register_forward_pre_hook(
                    self._make_forward_pre_hook())

    def disable_forward_pre_hook(self, param_sync: bool = True):
        """Remove the forward pre-hooks; with ``param_sync`` gather all params now (before eval or save)."""
        for handle in self._forward_pre_hook_handles.values():
            handle.remove()
        self._forward_pre_hook_handles = {}
        if param_sync:
            self.start_param_sync(force_sync=True)

    def _make_forward_pre_hook(self):
        param_to_bucket_group = self.param_to_bucket_group

        def hook(module, *unused):
            for param in module.parameters(recurse=False):
                group = param_to_bucket_group.get(param)
                if group is not None:
                    group.finish_param_sync()

        return hook

    def start_param_sync(self, force_sync: bool = False):
        """All-gather the updated param shards of every bucket (distributed optimizer only).

        Synchronous unless ``overlap_param_gather`` and not ``force_sync``; ``force_sync`` also
        completes gathers already in flight, so the full params are current on return.
        """
        with managed_span("communication", "megatron.param_sync.start"):
            for group in self.all_bucket_groups():
                group.start_param_sync(force_sync=force_sync)

    def mark_params_stale(self):
        """Record that the optimizer updated this rank's shards: the next gather must spread them."""
        for group in self.all_bucket_groups():
            group.params_stale = True

    def _make_backward_post_hook(self):
        overlap = self.ddp_config.overlap_grad_reduce
        param_to_bucket_group = self.param_to_bucket_group

        def hook(param: torch.nn.Parameter):
            # A fused wgrad kernel may already have written into main_grad (grad_added_to_main_grad);
            # a weight marked zero_out_wgrad (tied embedding) still carries other grads in .grad.
            if param.grad is not None and (not param.grad_added_to_main_grad or param.zero_out_wgrad):
                param.main_grad.add_(param.grad)
            param.grad = None
            if overlap:
                param_to_bucket_group[param].register_grad_ready(param)

        return hook

    def forward(self, *inputs, **kwargs):
        """Run the wrapped module unchanged."""
        return self.module(*inputs, **kwargs)

    @contextmanager
    def no_sync(self):
        """Accumulate grads without launching data-parallel collectives (all but the last microbatch)."""
        for group in self.all_bucket_groups():
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in self.all_bucket_groups():
                group.is_last_microbatch = True

    def start_grad_sync(self, *unused):
        """Launch the all-reduce of every bucket now (async with ``overlap_grad_reduce``)."""
        with managed_span("communication", "megatron.grad_sync.start"):
            for group in self.all_bucket_groups():
                group.start_grad_sync()

    def finish_grad_sync(self):
        """Complete (or, without overlap, perform) the all-reduce of every bucket; main_grads are then reduced.

        Buckets not launched yet (no ``overlap_grad_reduce``) are launched first under
        ``megatron.grad_sync.start``, so both spans of the spec's tree appear in every iteration.
        Then, with ``check_for_nan_in_grad`` and unless ``defer_nan_check``, :meth:`check_for_nan_in_grad`.
        """
        unlaunched = [] if self.ddp_config.overlap_grad_reduce else [
            group for group in self.all_bucket_groups() if not group._sync_launched]
        if unlaunched:
            with managed_span("communication", "megatron.grad_sync.start"):
                for group in unlaunched:
                    group.start_grad_sync()
        with managed_span("communication", "megatron.grad_sync.finish"):
            for group in self.all_bucket_groups():
                group.finish_grad_sync()
        if self.ddp_config.check_for_nan_in_grad and not self.defer_nan_check:
            self.check_for_nan_in_grad()

    def check_for_nan_in_grad(self):
        """Raise RuntimeError if a bucket's local grad norm, recorded before its collective, was NaN or Inf.

        One host read for all buckets of the step; nothing to read (no error) when no norms were
        recorded since the last :meth:`zero_grad_buffer` (``check_for_nan_in_grad`` off). The norms
        are dropped once read (:meth:`discard_local_grad_norms`).
        """
        norms = [group.local_grad_norms for group in self.all_bucket_groups() if group.local_grad_norms is not None]
        if not norms:
            return
        values = torch.cat(norms).tolist()
        self.discard_local_grad_norms()
        if not all(math.isfinite(value) for value in values):
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise RuntimeError(
                f"Rank {rank}: found NaN or Inf in local grad norm ({values}) in backward pass "
                f"before data-parallel communication collective"
            )

    def discard_local_grad_norms(self):
        """Drop the local grad norms recorded for this step once the NaN check has been decided.

        The norms are needed only until then; dropped here, nothing of a step's backward outlives the
        step (before, they stayed alive until the next :meth:`zero_grad_buffer`).
        """
        for group in self.all_bucket_groups():
            group.local_grad_norms = None

    def scale_gradients(self, scaling_factor: float):
        """Multiply every main_grad by ``scaling_factor`` (used for per-token loss normalisation)."""
        for buffer in self.all_buffers():
            buffer.scale_gradients(scaling_factor)

    def zero_grad_buffer(self):
        """Zero all main_grads and reset bucket state; call at the start of every iteration."""
        for buffer in self.all_buffers():
            for param in buffer.params:
                param.grad_added_to_main_grad = False
                # An optimizer may have aliased param.grad to main_grad; autograd would then
                # accumulate into the buffer and the hook would add the grad a second time.
                param.grad = None
            buffer.reset()
        for group in self.all_bucket_groups():
            group.reset()

    def broadcast_params(self):
        """Copy every param from the first rank of its data-parallel group: the data-parallel (with context-parallel)
        group, or the expert-data-parallel group for expert parameters (``allreduce = False``)."""
        for param in self.module.parameters():
            group = self.data_parallel_group if getattr(param, "allreduce", True) else self.expert_data_parallel_group
            dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)

    def gather_reduced_grads(self, params):
        """Make ``main_grad`` of ``params`` hold the whole reduced grad on every data-parallel rank.

        A no-op without the distributed optimizer (the all-reduce already leaves whole grads);
        with it, all-gathers the reduced shards of the buckets holding ``params`` (a collective:
        every data-parallel rank must call it with the same params). Call after :meth:`finish_grad_sync`.
        """
        if not self.ddp_config.use_distributed_optimizer:
            return
        groups = []
        for param in params:
            group = self.param_to_bucket_group.get(param)
            if group is not None and group not in groups:
                groups.append(group)
        order = self.all_bucket_groups()
        for group in sorted(groups, key=order.index):
            group.all_gather_grads()

    def sync_params_for_read(self):
        """Complete pending param gathers so the full params can be read (checkpoint save, eval, norms)."""
        if self.ddp_config.use_distributed_optimizer:
            self.start_param_sync(force_sync=True)

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The wrapped module's state dict (keys without a ``module.`` prefix)."""
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's checkpoint state dict (its own method when it has one)."""
        inner = getattr(self.module, "state_dict_for_save_checkpoint", None)
        if inner is not None:
            return inner(prefix=prefix, keep_vars=keep_vars)
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the wrapped module (keys as produced by :meth:`state_dict`)."""
        return self.module.load_state_dict(state_dict, strict=strict)
