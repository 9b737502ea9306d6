"""Tensor-parallel layers: ColumnParallelLinear, RowParallelLinear and VocabParallelEmbedding.

Partitioning follows Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", section 3; sequence parallelism follows Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2.2.
"""
from __future__ import annotations

import os
import warnings
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.parallel_state import (
    get_expert_tensor_parallel_rank,
    get_expert_tensor_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel.mappings import (
    _gather_along_first_dim,
    _start_gather_along_first_dim,
    _start_reduce,
    _start_reduce_scatter_along_first_dim,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
from megatron.core.tensor_parallel.utils import VocabUtility, divide
from megatron.core.tensor_parallel.wgrad import accumulate_weight_grad, cuda_wgrad_kernel

_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS = {"tensor_model_parallel": False, "partition_dim": -1, "partition_stride": 1}


def param_is_not_tensor_parallel_duplicate(param: torch.Tensor) -> bool:
    """True if ``param`` is TP-partitioned or this is TP rank 0 (count replicated params once)."""
    return bool(getattr(param, "tensor_model_parallel", False)) or get_tensor_model_parallel_rank() == 0


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int) -> None:
    """Mark ``tensor`` as TP-partitioned along ``dim`` with ``stride``.

    Raises AssertionError if the attributes were already set (a parameter is partitioned once).
    """
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        assert not hasattr(tensor, attribute), f"tensor already has attribute {attribute}"
    setattr(tensor, "tensor_model_parallel", is_parallel)
    setattr(tensor, "partition_dim", dim)
    setattr(tensor, "partition_stride", stride)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the replicated defaults (False, -1, 1) for any TP attribute it lacks."""
    for attribute, value in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, attribute):
            setattr(tensor, attribute, value)


def copy_tensor_model_parallel_attributes(destination_tensor: torch.Tensor, source_tensor: torch.Tensor) -> None:
    """Copy the TP attributes present on ``source_tensor`` onto ``destination_tensor``."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, attribute):
            setattr(destination_tensor, attribute, getattr(source_tensor, attribute))


def _initialize_affine_weight_gpu(weight: torch.Tensor, init_method: Callable, partition_dim: int,
                                  stride: int = 1, is_expert: bool = False, *,
                                  full_size: Optional[Tuple[int, int]] = None,
                                  per_partition_size: Optional[int] = None) -> None:
    """Initialise a weight that lives on the GPU.

    Dense weights (the default) are cut from a full fp32 master drawn on the GPU with the default
    CUDA generator, which is seeded identically on every TP rank, so TP=k starts from exactly the
    weights of TP=1 (``full_size`` = (output_size, input_size) and ``per_partition_size`` are
    required for that). The master exists for one layer at a time (e.g. 2 GiB for a 128k x 4k
    embedding). Without ``full_size`` (or with ``is_expert``) the shard is drawn directly, inside the
    expert- or model-parallel RNG fork; MoE expert linears do not come here: they take the master path
    by expert-TP rank (``_initialize_partitioned_weight``'s ``expert_tp``).
    """
    if not is_expert and full_size is not None:
        _initialize_affine_weight_from_master(weight, full_size[0], full_size[1], per_partition_size,
                                              partition_dim, init_method, stride, device=weight.device)
        return
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    name = "expert-parallel-rng" if is_expert else "model-parallel-rng"
    tracker = get_cuda_rng_tracker()
    if name in tracker.states_:
        with tracker.fork(name):
            init_method(weight)
    else:
        # No tracker seeded (e.g. a bare unit test): draw from the default generator.
        init_method(weight)


def _initialize_affine_weight_from_master(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable,
    stride: int = 1,
    *,
    device: torch.device,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> torch.Tensor:
    """Draw the full fp32 master [output_size, input_size] on ``device`` and copy this rank's slice.

    The master is split along ``partition_dim`` into chunks of ``per_partition_size / stride`` and
    this rank keeps ``chunks[rank::world_size]``, so every TP size starts from the same full matrix
    (stride > 1 keeps e.g. the gate and up halves of SwiGLU's fused fc1 together per rank).
    Returns the master (cast to the weight's dtype).
    """
    set_tensor_model_parallel_attributes(weight, is_parallel=True, dim=partition_dim, stride=stride)
    master_weight = torch.empty(output_size, input_size, dtype=torch.float32, device=device, requires_grad=False)
    init_method(master_weight)
    master_weight = master_weight.to(dtype=weight.dtype)
    per_partition_per_stride_size = divide(per_partition_size, stride)
    chunks = torch.split(master_weight, per_partition_per_stride_size, dim=partition_dim)
    if rank is None:
        rank = get_tensor_model_parallel_rank()
        world_size = get_tensor_model_parallel_world_size()
    own = chunks[rank::world_size]
    with torch.no_grad():
        weight.data.copy_(torch.cat(own, dim=partition_dim))
    return master_weight


def _initialize_affine_weight_cpu(
    weight: torch.Tensor,
    output_size: int,
    input_size: int,
    per_partition_size: int,
    partition_dim: int,
    init_method: Callable,
    stride: int = 1,
    return_master_weight: bool = False,
    *,
    params_dtype: torch.dtype = torch.float32,
    rank: Optional[int] = None,
    world_size: Optional[int] = None,
) -> Optional[torch.Tensor]:
    """``--use-cpu-initialization``: the master-weight slice of :func:`_initialize_affine_weight_from_master`
    drawn with the CPU generator; returns the master (in ``params_dtype``) if ``return_master_weight``."""
    master_weight = _initialize_affine_weight_from_master(
        weight, output_size, input_size, per_partition_size, partition_dim, init_method, stride,
        device=torch.device("cpu"), rank=rank, world_size=world_size,
    )
    return master_weight.to(params_dtype) if return_master_weight else None


def _use_cpu_init(config: ModelParallelConfig) -> bool:
    # Without CUDA the CPU master-weight path is the only one.
    return config.use_cpu_initialization or not torch.cuda.is_available()


def _param_device(config: ModelParallelConfig) -> Optional[torch.device]:
    if config.use_cpu_initialization or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def _initialize_partitioned_weight(weight: torch.Tensor, config: ModelParallelConfig, init_method: Callable,
                                   full_size: Tuple[int, int], per_partition_size: int, partition_dim: int,
                                   stride: int = 1, is_expert: bool = False,
                                   keep_master_weight_for_test: bool = False,
                                   expert_tp: Optional[Tuple[int, int]] = None) -> Optional[torch.Tensor]:
    """Mark ``weight`` as split along ``partition_dim`` and, unless ``config.perform_initialization``
    is off, fill it: the CPU master-weight path without CUDA or with ``use_cpu_initialization``,
    else the GPU path. Returns the full master when ``keep_master_weight_for_test`` (CPU path only).

    ``expert_tp`` = (expert-TP rank, expert-TP size) for a MoE expert's weight: its shard is cut from
    the expert's full fp32 master like a dense weight (on the GPU too), by the expert-TP rank, so an
    expert starts from the same weights at any expert-parallel / expert-TP size (the MoE layer draws
    the masters of the other ranks' experts in the same order; ``moe/experts.py``)."""
    if not config.perform_initialization:
        set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
        return None
    if expert_tp is not None:
        device = torch.device("cpu") if _use_cpu_init(config) else weight.device
        master = _initialize_affine_weight_from_master(
            weight, full_size[0], full_size[1], per_partition_size, partition_dim, init_method, stride,
            device=device, rank=expert_tp[0], world_size=expert_tp[1],
        )
        return master.to(config.params_dtype) if keep_master_weight_for_test else None
    if _use_cpu_init(config):
        return _initialize_affine_weight_cpu(
            weight, full_size[0], full_size[1], per_partition_size, partition_dim, init_method, stride=stride,
            return_master_weight=keep_master_weight_for_test, params_dtype=config.params_dtype,
        )
    _initialize_affine_weight_gpu(weight, init_method, partition_dim=partition_dim, stride=stride,
                                  is_expert=is_expert, full_size=full_size, per_partition_size=per_partition_size)
    return None


def _expert_tp_size_rank(tp_group) -> Tuple[int, int]:
    """(size, rank) of the expert-TP group: ``tp_group`` when given, else parallel_state's."""
    if tp_group is not None:
        return torch.distributed.get_world_size(tp_group), torch.distributed.get_rank(tp_group)
    return get_expert_tensor_parallel_world_size(), get_expert_tensor_parallel_rank()


_warned_max_connections = False


def _prepare_cuda_backward(config: ModelParallelConfig, communicates_in_backward: bool) -> None:
    """On a CUDA machine: pick the fused-wgrad kernel now (probed once, outside any compiled
    region), and warn once if the backward's collectives cannot overlap in order (see
    :class:`LinearWithGradAccumulationAndAsyncCommunication`). Does nothing without CUDA."""
    global _warned_max_connections
    if not torch.cuda.is_available():
        return
    if config.gradient_accumulation_fusion:
        # Float16Module may cast fp32-built params to the --bf16/--fp16 dtype after construction.
        dtypes = {config.params_dtype, torch.bfloat16 if config.bf16 else None, torch.float16 if config.fp16 else None}
        for dtype in dtypes & {torch.bfloat16, torch.float16}:
            cuda_wgrad_kernel(torch.device("cuda", torch.cuda.current_device()), dtype)
    if communicates_in_backward and not _warned_max_connections \
            and os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        _warned_max_connections = True
        warnings.warn("tensor-parallel backward overlaps its collectives with the GEMMs only with "
                      "CUDA_DEVICE_MAX_CONNECTIONS=1 in the environment before CUDA starts "
                      "(export it in the launch script, as Megatron-LM does)")


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """``Y = X Wᵀ + b``: the one implementation of both tensor-parallel linear layers' math.

    input [s, b, in] (or this rank's [s/tp, b, in], gathered on dim 0, with ``sequence_parallel``);
    weight [out, in]; bias [out] or None; output [s, b, out].

    Backward (Megatron-LM's order; Korthikanti et al. 2022, section 4.2.2) overlaps the TP
    communication with the two GEMMs:

    1. with ``sequence_parallel``, start the all-gather of the saved [s/tp, b, in] input (async);
    2. dgrad = grad_output @ W;
    3. wait for the all-gather; start the reduce-scatter of dgrad (``sequence_parallel``) or its
       all-reduce (``allreduce_dgrad``), async;
    4. wgrad = grad_outputᵀ @ X (into ``weight.main_grad`` with ``gradient_accumulation_fusion``,
       see :func:`accumulate_weight_grad`), and the bias grad;
    5. wait for the dgrad collective.

    On CUDA the collectives run on NCCL's stream; the all-gather only gets ahead of the dgrad GEMM
    when kernels reach the GPU in launch order, which needs ``CUDA_DEVICE_MAX_CONNECTIONS=1`` in the
    environment before CUDA starts (as Megatron-LM's launch scripts export it). Without it the
    numbers are the same and only the overlap is lost.

    Gradients not needed by autograd (``ctx.needs_input_grad``: frozen weight, input that needs no
    grad, no bias) are not computed. With ``gradient_accumulation_fusion`` the weight gradient is
    added into ``weight.main_grad`` and the returned gradient is a dummy for DDP's hook
    (``grad_added_to_main_grad``; zeros when ``zero_out_wgrad``, e.g. a tied embedding whose lookup
    grad still arrives through autograd). Raises RuntimeError if the weight has no ``main_grad``.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel):
        ctx.save_for_backward(input_, weight)
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        total_input = _gather_along_first_dim(input_) if sequence_parallel else input_
        return F.linear(total_input, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        need_dgrad, need_wgrad, need_bgrad = ctx.needs_input_grad[:3]

        total_input, gather_pending = input_, None
        if ctx.sequence_parallel and need_wgrad:
            total_input, gather_pending = _start_gather_along_first_dim(input_)

        grad_input = grad_output.matmul(weight) if need_dgrad else None

        if gather_pending is not None:
            gather_pending.wait()
        dgrad_pending = None
        if grad_input is not None:
            if ctx.sequence_parallel:
                grad_input, dgrad_pending = _start_reduce_scatter_along_first_dim(grad_input)
            elif ctx.allreduce_dgrad:
                grad_input, dgrad_pending = _start_reduce(grad_input)

        grad_output_2d = grad_output.reshape(-1, grad_output.size(-1))
        grad_weight = None
        if need_wgrad:
            total_input_2d = total_input.reshape(-1, total_input.size(-1))
            if ctx.gradient_accumulation_fusion:
                grad_weight = _fused_weight_grad(weight, grad_output_2d, total_input_2d)
            else:
                grad_weight = grad_output_2d.t().matmul(total_input_2d)
        grad_bias = grad_output_2d.sum(dim=0) if ctx.use_bias and need_bgrad else None

        if dgrad_pending is not None:
            dgrad_pending.wait()
        return grad_input, grad_weight, grad_bias, None, None, None


def _fused_weight_grad(weight: torch.Tensor, grad_output_2d: torch.Tensor,
                       total_input_2d: torch.Tensor) -> Optional[torch.Tensor]:
    """Add ``grad_output_2dᵀ @ total_input_2d`` into ``weight.main_grad``; return the grad autograd gets."""
    if not hasattr(weight, "main_grad"):
        raise RuntimeError(
            "gradient_accumulation_fusion requires weight.main_grad (wrap the model in "
            "DistributedDataParallel before running backward)"
        )
    accumulate_weight_grad(weight.main_grad, grad_output_2d, total_input_2d)
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    # The DDP hook learns that the grad is already in main_grad from the flag the forward set
    # (see linear_with_grad_accumulation_and_async_allreduce); autograd still needs a tensor.
    return torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
) -> torch.Tensor:
    """Functional form of :class:`LinearWithGradAccumulationAndAsyncCommunication`.

    With ``gradient_accumulation_fusion`` the weight's ``grad_added_to_main_grad`` (DDP's flag, reset
    by ``zero_grad_buffer``) is set here, before the autograd Function runs, not in its backward:
    every backward of this call adds the weight grad into ``main_grad``, and torch.compile cannot
    trace a Python attribute write inside an autograd Function (each one split the graph).
    """
    if gradient_accumulation_fusion and weight.requires_grad and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
    return LinearWithGradAccumulationAndAsyncCommunication.apply(
        input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel
    )


class _ExtraStateMixin:
    """Emit ``<prefix>._extra_state`` = None like Megatron's local linear layers (TE stores metadata there)."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        # Checkpoints from the Transformer-Engine implementation carry metadata we do not use.
        return None


class ColumnParallelLinear(_ExtraStateMixin, torch.nn.Module):
    """Linear layer ``Y = X Aᵀ + b`` with A split along its output dimension: A = [A_1; ...; A_tp].

    Weight per rank [output_size/tp, input_size] (partition_dim 0), bias [output_size/tp] zero-init.
    forward(input [s, b, in] ([s/tp, b, in] with sequence parallel), weight=None) returns
    ``(output [s, b, out/tp] (or [s, b, out] with gather_output), bias-or-None)``; the bias is
    returned instead of added when ``skip_bias_add``. With ``skip_weight_param_allocation`` the
    weight must be passed to forward (tied output layer).

    Raises ValueError if ``output_size`` is not divisible by the TP size, and RuntimeError if
    forward gets no weight while the layer owns none, or gather_output is used with sequence parallel.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        is_expert: bool = False,
        disable_grad_reduce: bool = False,
        tp_group=None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.disable_grad_reduce = disable_grad_reduce
        self.config = config
        expert_tp = None
        if is_expert:
            # A MoE expert is split over the expert-TP group (``tp_group``, else parallel_state's), and
            # its token dispatcher does every collective (Megatron's explicit_expert_comm): no
            # sequence-parallel gather and no dgrad all-reduce here.
            world_size, expert_rank = _expert_tp_size_rank(tp_group)
            expert_tp = (expert_rank, world_size)
            self.sequence_parallel = False
            self.allreduce_dgrad = False
        else:
            world_size = get_tensor_model_parallel_world_size()
            self.sequence_parallel = config.sequence_parallel and world_size > 1
            self.allreduce_dgrad = world_size > 1 and not self.sequence_parallel and not disable_grad_reduce
        self.tp_world_size = world_size
        self.output_size_per_partition = divide(output_size, world_size)
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        self.master_weight = None
        _prepare_cuda_backward(config, self.allreduce_dgrad or self.sequence_parallel)

        if not skip_weight_param_allocation:
            self.weight = Parameter(torch.empty(self.output_size_per_partition, input_size,
                                                device=_param_device(config), dtype=config.params_dtype))
            self.master_weight = _initialize_partitioned_weight(
                self.weight, config, init_method, (output_size, input_size), self.output_size_per_partition, 0,
                stride=stride, is_expert=is_expert, keep_master_weight_for_test=keep_master_weight_for_test,
                expert_tp=expert_tp,
            )
            setattr(self.weight, "allreduce", not is_expert)
        else:
            self.weight = None

        if bias:
            self.bias = Parameter(torch.empty(self.output_size_per_partition, device=_param_device(config),
                                              dtype=config.params_dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0, stride)
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            setattr(self.bias, "allreduce", not is_expert)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """input [s, b, in] -> (output [s, b, out/tp] or gathered [s, b, out], bias or None)."""
        if weight is None:
            if self.weight is None:
                raise RuntimeError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True; pass weight to forward"
                )
            weight = self.weight
        elif weight.shape != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(
                f"supplied weight has shape {tuple(weight.shape)}, expected "
                f"{(self.output_size_per_partition, self.input_size)}"
            )
        bias = self.bias if not self.skip_bias_add else None

        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_, weight, bias, self.gradient_accumulation_fusion, self.allreduce_dgrad, self.sequence_parallel
        )

        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather and self.is_expert:
            raise RuntimeError("gather_output is not supported for expert layers (the token dispatcher gathers)")
        if gather:
            if self.sequence_parallel:
                raise RuntimeError("gather_output is not supported together with sequence_parallel")
            output = gather_from_tensor_model_parallel_region(output_parallel)
        else:
            output = output_parallel
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.tp_world_size}, "
                f"gather_output={self.gather_output}")


class RowParallelLinear(_ExtraStateMixin, torch.nn.Module):
    """Linear layer ``Y = X Aᵀ + b`` with A split along its input dimension: A = [A_1, ..., A_tp].

    Weight per rank [output_size, input_size/tp] (partition_dim 1); the bias [output_size] is not
    partitioned and is added after the TP reduction (returned instead with ``skip_bias_add``).
    forward(input [s, b, in/tp] if ``input_is_parallel`` else [s, b, in]) returns
    ``(output [s, b, out] ([s/tp, b, out] with sequence parallel), bias-or-None)``.

    Raises ValueError if ``input_size`` is not divisible by the TP size and RuntimeError if
    sequence parallelism is requested without ``input_is_parallel``.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: ModelParallelConfig,
        init_method: Callable,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_group=None,
    ):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.is_expert = is_expert
        self.config = config
        expert_tp = None
        if is_expert:
            # Expert-TP split; the output's partial sums are reduced by the token dispatcher.
            world_size, expert_rank = _expert_tp_size_rank(tp_group)
            expert_tp = (expert_rank, world_size)
            if not input_is_parallel:
                raise RuntimeError("expert RowParallelLinear needs input_is_parallel=True")
            self.sequence_parallel = False
        else:
            world_size = get_tensor_model_parallel_world_size()
            self.sequence_parallel = config.sequence_parallel and world_size > 1
        self.tp_world_size = world_size
        self.input_size_per_partition = divide(input_size, world_size)
        self.gradient_accumulation_fusion = config.gradient_accumulation_fusion
        if self.sequence_parallel and not input_is_parallel:
            raise RuntimeError("To enable `sequence_parallel`, `input_is_parallel` must be `True`")
        self.master_weight = None
        _prepare_cuda_backward(config, communicates_in_backward=False)

        self.weight = Parameter(torch.empty(output_size, self.input_size_per_partition,
                                            device=_param_device(config), dtype=config.params_dtype))
        self.master_weight = _initialize_partitioned_weight(
            self.weight, config, init_method, (output_size, input_size), self.input_size_per_partition, 1,
            stride=stride, is_expert=is_expert, keep_master_weight_for_test=keep_master_weight_for_test,
            expert_tp=expert_tp,
        )
        setattr(self.weight, "allreduce", not is_expert)

        if bias:
            self.bias = Parameter(torch.empty(output_size, device=_param_device(config), dtype=config.params_dtype))
            if config.perform_initialization:
                with torch.no_grad():
                    self.bias.zero_()
            setattr(self.bias, "allreduce", not is_expert)
            # Under SP each rank adds the bias to its own sequence chunk, so its grad is partial.
            setattr(self.bias, "sequence_parallel", self.sequence_parallel)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """input [s, b, in/tp] (or full [s, b, in]) -> (output [s, b, out], bias or None)."""
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_)
        # The input grad of a row-parallel matmul is already this rank's shard: no dgrad collective.
        output_parallel = linear_with_grad_accumulation_and_async_allreduce(
            input_parallel, self.weight, None, self.gradient_accumulation_fusion, False, False
        )
        if self.is_expert:
            output_ = output_parallel  # partial over expert TP: the token dispatcher reduces it
        elif self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel)
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel)
        if self.skip_bias_add:
            return output_, self.bias
        output = output_ + self.bias if self.bias is not None else output_
        return output, None

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, "
                f"bias={self.bias is not None}, TP={self.tp_world_size}, "
                f"input_is_parallel={self.input_is_parallel}")


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary: rank r owns ids [r*V/tp, (r+1)*V/tp).

    Weight per rank [V/tp, h] (partition_dim 0). forward(input_ids [b, s]) -> [b, s, h]: ids
    outside the rank's range read row 0 and are zeroed, then the partial results are all-reduced
    over TP; with ``reduce_scatter_embeddings`` the output is transposed to [s, b, h] and
    reduce-scattered to [s/tp, b, h] (sequence parallel).

    Raises ValueError if ``num_embeddings`` is not divisible by the TP size.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, init_method: Callable,
                 reduce_scatter_embeddings: bool = False, config: ModelParallelConfig):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        world_size = get_tensor_model_parallel_world_size()
        rank = get_tensor_model_parallel_rank()
        self.tensor_model_parallel_size = world_size
        if num_embeddings % world_size != 0:
            raise ValueError(
                f"VocabParallelEmbedding: num_embeddings ({num_embeddings}) is not divisible by "
                f"tensor_model_parallel_size ({world_size}); pad the vocabulary (--make-vocab-size-divisible-by)"
            )
        self.vocab_start_index, self.vocab_end_index = VocabUtility.vocab_range_from_global_vocab_size(
            num_embeddings, rank, world_size
        )
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index

        self.weight = Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                            device=_param_device(config), dtype=config.params_dtype))
        _initialize_partitioned_weight(self.weight, config, init_method, (num_embeddings, embedding_dim),
                                       self.num_embeddings_per_partition, 0)
        setattr(self.weight, "allreduce", True)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """input_ids [b, s] (int64) -> embeddings [b, s, h] ([s/tp, b, h] with reduce_scatter_embeddings)."""
        if self.tensor_model_parallel_size > 1:
            input_mask = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            masked_input = (input_ - self.vocab_start_index).masked_fill(input_mask, 0)
            output_parallel = F.embedding(masked_input, self.weight)
            output_parallel = output_parallel.masked_fill(input_mask.unsqueeze(-1), 0.0)
        else:
            output_parallel = F.embedding(input_, self.weight)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel)
        return reduce_from_tensor_model_parallel_region(output_parallel)
