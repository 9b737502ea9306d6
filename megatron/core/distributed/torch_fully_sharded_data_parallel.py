"""FSDP2 wrapper (``--use-torch-fsdp2``): torch's ``fully_shard`` per transformer layer, embedding, output layer and root."""
import math
from contextlib import contextmanager
from typing import Dict, List

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megatron.core.collective_device import get_collective_device

from .torch_fully_sharded_data_parallel_config import TorchFullyShardedDataParallelConfig


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (a view of its storage), the tensor itself otherwise."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class TorchFullyShardedDataParallel(torch.nn.Module):
    """Shard ``module``'s parameters, gradients and (through the optimizer) its state over data-parallel ranks.

    Megatron-LM core_v0.14's ``TorchFullyShardedDataParallel``: torch's FSDP2
    (``torch.distributed.fsdp.fully_shard``, no sharding of our own) on a one-dimensional
    :class:`DeviceMesh` over the data-parallel-with-context-parallel group. One FSDP unit per
    ``TransformerLayer``, one for the embedding, one for the output layer, and the root (final norm
    and anything left). Every parameter becomes a ``DTensor`` sharded on dimension 0 (torch's
    ``Shard(0)``, uneven sizes allowed); a tensor-parallel parameter is the TP-local tensor sharded
    once more over DP, a 2-D layout. The parameter attributes that describe the TP split
    (``tensor_model_parallel``, ``partition_dim``, ``partition_stride``, ``sequence_parallel``, ...)
    are copied onto the sharded parameters, so grad norms, TP grad reductions and checkpoints treat
    them as before.

    Gradients are reduce-scattered (averaged over the group) in each unit's backward; ``no_sync``
    defers that to the last micro-batch (unsharded grads accumulate meanwhile). Under bf16 the
    parameters are bf16 and the reduction runs in fp32 (``MixedPrecisionPolicy(reduce_dtype=fp32)``);
    the optimizer keeps fp32 main copies of the local shards. ``overlap_param_gather`` /
    ``overlap_grad_reduce`` prefetch the next layer's all-gather in forward / backward.

    The methods the training loop calls on :class:`DistributedDataParallel` exist here with the same
    meaning, so the loop needs no FSDP case beyond choosing this wrapper.

    Args:
        config: the model's TransformerConfig (``bf16``, ``calculate_per_token_loss``).
        ddp_config: a :class:`TorchFullyShardedDataParallelConfig`.
        module: the model chunk (already on its device and in its dtype).
        disable_bucketing: accepted for the DDP signature; no effect.
    """

    def __init__(self, config, ddp_config: TorchFullyShardedDataParallelConfig, module: torch.nn.Module,
                 disable_bucketing: bool = False):
        super().__init__()
        from megatron.core import parallel_state
        from megatron.core.transformer.transformer_layer import TransformerLayer

        del disable_bucketing
        self.config = config
        self.ddp_config = ddp_config
        self.data_parallel_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
        self.defer_nan_check = False
        device_type = get_collective_device(self.data_parallel_group).type
        self.device_mesh = DeviceMesh.from_group(self.data_parallel_group, device_type)
        # Every rank starts from the same weights (as DDP's broadcast makes sure), then keeps its shard.
        self._broadcast_full_params(module)
        saved_attributes = {name: dict(vars(param)) for name, param in module.named_parameters()}

        reduce_fp32 = bool(getattr(config, "bf16", False) or ddp_config.grad_reduce_in_fp32)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32 if reduce_fp32 else None)
        kwargs = dict(mesh=self.device_mesh, reshard_after_forward=ddp_config.reshard_after_forward, mp_policy=policy)
        layers = [m for m in module.modules() if isinstance(m, TransformerLayer)]
        units = list(layers)
        for name in ("embedding", "output_layer"):
            sub = getattr(module, name, None)
            if isinstance(sub, torch.nn.Module) and any(True for _ in sub.parameters()):
                units.append(sub)
        for unit in units:
            fully_shard(unit, **kwargs)
        fully_shard(module, **kwargs)
        self.module = module
        self._units: List[FSDPModule] = [*units, module]

        # fully_shard replaced every parameter by a new DTensor parameter: give back the attributes.
        for name, param in module.named_parameters():
            for attribute, value in saved_attributes.get(name, {}).items():
                setattr(param, attribute, value)
        # FSDP2 averages over the group. With --calculate-per-token-loss the grads must be the sum, which
        # finalize_model_grads divides by the global token count (scale_gradients): that scale takes the
        # group size back out (a divide factor of 1 would need PREMUL_SUM, which gloo lacks).
        self._per_token_rescale = (float(dist.get_world_size(self.data_parallel_group))
                                   if getattr(config, "calculate_per_token_loss", False) else 1.0)
        if ddp_config.overlap_param_gather:
            for current, following in zip(layers, layers[1:]):
                current.set_modules_to_forward_prefetch([following])
        if ddp_config.overlap_grad_reduce:
            for current, previous in zip(layers[1:], layers):
                current.set_modules_to_backward_prefetch([previous])

    def _broadcast_full_params(self, module: torch.nn.Module):
        if dist.get_world_size(self.data_parallel_group) == 1:
            return
        src = dist.get_global_rank(self.data_parallel_group, 0)
        with torch.no_grad():
            for param in module.parameters():
                dist.broadcast(param.data, src=src, group=self.data_parallel_group)

    def forward(self, *inputs, **kwargs):
        """Run the wrapped (root FSDP) module."""
        return self.module(*inputs, **kwargs)

    # ---- the data-parallel wrapper's interface -------------------------------------------------

    @contextmanager
    def no_sync(self):
        """Accumulate unsharded grads without reduce-scatter (all but the last micro-batch)."""
        self.module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.module.set_requires_gradient_sync(True)

    def start_grad_sync(self, *unused):
        """Nothing to launch: FSDP2 reduce-scatters each unit during backward."""

    def finish_grad_sync(self):
        """The reduce-scatters completed with backward; with ``check_for_nan_in_grad`` (not deferred), check."""
        if self.ddp_config.check_for_nan_in_grad and not self.defer_nan_check:
            self.check_for_nan_in_grad()

    def check_for_nan_in_grad(self):
        """Raise RuntimeError naming the rank if a local grad shard holds NaN or Inf."""
        grads = [_local(p.grad).detach() for p in self.module.parameters() if p.grad is not None]
        if not grads:
            return
        norms = torch.stack([g.float().norm() for g in grads]).tolist()
        if not all(math.isfinite(value) for value in norms):
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise RuntimeError(f"Rank {rank}: found NaN or Inf in local grad norm ({norms}) in backward pass "
                               "after data-parallel communication collective")

    def discard_local_grad_norms(self):
        """Nothing is recorded in backward; kept for the loop's NaN check."""

    def scale_gradients(self, scaling_factor: float):
        """Multiply every local grad shard by ``scaling_factor`` (per-token loss normalisation; with
        ``calculate_per_token_loss`` also by the group size, undoing FSDP2's average into a sum)."""
        scaling_factor = scaling_factor * self._per_token_rescale
        with torch.no_grad():
            for param in self.module.parameters():
                if param.grad is not None:
                    _local(param.grad).mul_(scaling_factor)

    def zero_grad_buffer(self):
        """Drop the grads of the last step (FSDP2 allocates sharded grads anew in backward)."""
        for param in self.module.parameters():
            param.grad = None

    def broadcast_params(self):
        """Done before sharding, in the constructor (the shards then differ by design)."""

    def gather_reduced_grads(self, params):
        """No-op: pipeline parallelism (the only caller's case) is refused with FSDP2."""

    def start_param_sync(self, force_sync: bool = False):
        """No-op: FSDP2 gathers parameters in each unit's forward."""

    def mark_params_stale(self):
        """No-op: the optimizer updates the shards FSDP2 gathers from."""

    def sync_params_for_read(self):
        """No-op: the shards are current (checkpoints save shards)."""

    def enable_forward_pre_hook(self):
        """No-op: FSDP2's own hooks gather parameters."""

    def disable_forward_pre_hook(self, param_sync: bool = True):
        """No-op: FSDP2's own hooks gather parameters."""

    def state_dict(self, *args, destination=None, prefix="", keep_vars=False):
        """The wrapped module's state dict (DTensor shards; keys without a ``module.`` prefix)."""
        return self.module.state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The wrapped module's state dict (the legacy ``torch`` format is refused with FSDP2)."""
        return self.module.state_dict(prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load into the wrapped module (values: DTensors of the same sharding)."""
        return self.module.load_state_dict(state_dict, strict=strict)

    def local_param_bytes(self) -> Dict[str, int]:
        """Bytes of this rank's parameter and gradient shards (for memory reports)."""
        params = sum(_local(p).numel() * p.element_size() for p in self.module.parameters())
        grads = sum(_local(p.grad).numel() * p.grad.element_size() for p in self.module.parameters()
                    if p.grad is not None)
        return {"params": params, "grads": grads}
