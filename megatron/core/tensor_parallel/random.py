"""Named RNG states (model-parallel, data-parallel, expert) and activation recomputation that replays them."""
from __future__ import annotations

import contextlib
import struct
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from megatron.core.parallel_state import (
    get_expert_model_parallel_rank,
    get_expert_tensor_parallel_rank,
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
_DATA_PARALLEL_RNG_TRACKER_NAME = "data-parallel-rng"
_EXPERT_PARALLEL_RNG_TRACKER_NAME = "expert-parallel-rng"


def _device_rng_uses_cuda() -> bool:
    return torch.cuda.is_available()


def cuda_generator_state(seed: int, offset: int = 0) -> torch.Tensor:
    """The state ``torch.cuda.get_rng_state()`` returns after ``torch.cuda.manual_seed(seed)`` once
    ``offset`` Philox offsets were drawn: a uint8 CPU tensor of 16 bytes, the uint64 seed then the
    int64 offset in the machine's byte order (torch's CUDAGeneratorImpl::get_state). Built without
    CUDA, so a checkpoint written on a CPU carries CUDA states Megatron-LM can restore on a GPU."""
    packed = struct.pack("=Qq", seed % 2**64, offset)  # "=": native byte order, standard sizes
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8).clone()


# Seed model_parallel_cuda_manual_seed gave the device generator (None before it ran).
_DEVICE_SEED: Optional[int] = None


def seeded_cuda_rng_states() -> Optional[Dict[str, Any]]:
    """``{'cuda_rng_state': ..., 'rng_tracker_states': {name: ...}}`` in CUDA's format as a GPU run
    seeded like this one holds them right after seeding (offset 0: the draws made since are not
    representable, they were made on another generator); None before the seeding."""
    tracker = get_cuda_rng_tracker()
    if _DEVICE_SEED is None or not tracker.seed_of_:
        return None
    return {"cuda_rng_state": cuda_generator_state(_DEVICE_SEED),
            "rng_tracker_states": {name: cuda_generator_state(seed) for name, seed in tracker.seed_of_.items()}}


def _get_device_rng_state() -> torch.Tensor:
    """RNG state of the device that dropout runs on: the current CUDA device, else the CPU."""
    if _device_rng_uses_cuda():
        return torch.cuda.get_rng_state()
    return torch.get_rng_state()


def _set_device_rng_state(state: torch.Tensor) -> None:
    if _device_rng_uses_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _device_manual_seed(seed: int) -> None:
    if _device_rng_uses_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


# Seed of the layout-independent weight initialisation (model_init_rng); None: draw from the default generator.
_MODEL_INIT_SEED: Optional[int] = None


def set_model_init_seed(seed: Optional[int]) -> None:
    """Seed from which ``model_init_rng`` derives each model piece's generator (None turns it off)."""
    global _MODEL_INIT_SEED
    _MODEL_INIT_SEED = seed


@contextlib.contextmanager
def model_init_rng(piece: int):
    """Weights drawn inside come from generators seeded with (init seed, ``piece``), outer state untouched.

    ``piece`` numbers the model's pieces in layer order (0: embeddings, n: transformer layer n,
    num_layers + 1: output layer), so a piece gets the same weights on whichever pipeline stage
    (or virtual stage) builds it: a PP=k run starts from exactly the weights of PP=1. (Megatron-LM
    instead seeds each stage with ``seed + 100 * pp_rank``, so its pipeline layouts start from
    different weights.) Without ``set_model_init_seed`` this is a no-op.
    """
    if _MODEL_INIT_SEED is None:
        yield
        return
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(_MODEL_INIT_SEED + 7919 * (piece + 1))  # manual_seed seeds CPU and every CUDA device
        yield


def get_data_parallel_rng_tracker_name() -> str:
    """Name of the RNG state shared by all TP ranks."""
    return _DATA_PARALLEL_RNG_TRACKER_NAME


def get_expert_parallel_rng_tracker_name() -> str:
    """Name of the RNG state used inside expert layers."""
    return _EXPERT_PARALLEL_RNG_TRACKER_NAME


class CudaRNGStatesTracker:
    """Keep named device RNG states and swap one in for the duration of ``fork(name)``.

    On CUDA machines the states are CUDA generator states of the current device; without CUDA the
    CPU generator is used, so the same code (dropout inside TP regions) is reproducible on CPU.
    The tracker's states are saved in checkpoints via ``get_states``/``set_states``.
    """

    def __init__(self):
        self.reset()

    def is_initialized(self) -> bool:
        """True once at least one state has been added."""
        return self._is_initialized

    def reset(self) -> None:
        """Forget all states and seeds."""
        self._is_initialized = False
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_ = set()
        # {name: seed it was added with}; kept by set_states (a loaded state continues that stream).
        self.seed_of_: Dict[str, int] = {}

    def get_states(self) -> Dict[str, torch.Tensor]:
        """Copy of ``{name: rng_state}`` (a uint8 tensor each) for checkpointing."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        """Replace all states (e.g. from a checkpoint); seeds are not tracked afterwards."""
        self._is_initialized = True
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create state ``name`` seeded with ``seed`` without disturbing the current RNG state.

        Raises RuntimeError if the seed or the name is already registered.
        """
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"cuda rng state {name} already exists")
        self._is_initialized = True
        self.seeds_.add(seed)
        self.seed_of_[name] = seed
        original = _get_device_rng_state()
        _device_manual_seed(seed)
        self.states_[name] = _get_device_rng_state()
        _set_device_rng_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME):
        """Run the body with RNG state ``name``; its advanced state is stored back on exit.

        Raises RuntimeError if ``name`` was never added.
        """
        if name not in self.states_:
            raise RuntimeError(f"cuda rng state {name} is not added")
        original = _get_device_rng_state()
        _set_device_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_device_rng_state()
            _set_device_rng_state(original)


_CUDA_RNG_STATE_TRACKER: Optional[CudaRNGStatesTracker] = None


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide RNG states tracker."""
    global _CUDA_RNG_STATE_TRACKER
    if _CUDA_RNG_STATE_TRACKER is None:
        _CUDA_RNG_STATE_TRACKER = CudaRNGStatesTracker()
    return _CUDA_RNG_STATE_TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the device generator and (re)create the tracker's named states (Megatron's offsets).

    data-parallel-rng = seed (same on all TP ranks), model-parallel-rng = seed + 2718 + tp_rank
    (different per TP rank, for dropout on TP-split activations), expert-parallel-rng =
    seed + 1024 + 100 * ep_rank + expert_tp_rank.
    """
    tensor_model_parallel_seed = seed + 2718 + get_tensor_model_parallel_rank()
    expert_parallel_seed = seed + 1024 + 100 * get_expert_model_parallel_rank() + get_expert_tensor_parallel_rank()
    global _DEVICE_SEED
    tracker = get_cuda_rng_tracker()
    tracker.reset()
    _device_manual_seed(seed)
    _DEVICE_SEED = seed
    tracker.add(_DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, tensor_model_parallel_seed)
    tracker.add(_EXPERT_PARALLEL_RNG_TRACKER_NAME, expert_parallel_seed)


# --------------------------------------------------------------------------------------------
# Activation recomputation
# --------------------------------------------------------------------------------------------
def _split_1d_own_chunk(tensor: torch.Tensor) -> torch.Tensor:
    """This TP rank's equal 1-D chunk of ``tensor`` (a copy, so the full buffer can be freed)."""
    world_size = get_tensor_model_parallel_world_size()
    flat = tensor.reshape(-1)
    chunk = flat.numel() // world_size
    start = get_tensor_model_parallel_rank() * chunk
    return flat[start:start + chunk].clone()


def _gather_1d_chunks(chunk: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    world_size = get_tensor_model_parallel_world_size()
    full = torch.empty(chunk.numel() * world_size, dtype=chunk.dtype, device=chunk.device)
    dist.all_gather(list(full.chunk(world_size)), chunk, group=get_tensor_model_parallel_group())
    return full.view(shape)


class CheckpointFunction(torch.autograd.Function):
    """Run ``function`` without keeping activations and recompute it during backward.

    The CPU, device and tracker RNG states at forward time are restored for the recomputation, so
    dropout masks are identical (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost";
    Megatron-LM's tensor_parallel.random.CheckpointFunction). With ``distribute_saved_activations``
    the first argument is kept as a 1-D shard per TP rank and all-gathered again in backward.
    """

    @staticmethod
    def forward(ctx, function, distribute_saved_activations, *args):
        ctx.function = function
        ctx.fwd_cpu_rng_state = torch.get_rng_state()
        ctx.fwd_cuda_rng_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        ctx.fwd_tracker_states = get_cuda_rng_tracker().get_states()

        with torch.no_grad():
            outputs = function(*args)

        tensor_indices, tensors, others = [], [], []
        for i, arg in enumerate(args):
            if torch.is_tensor(arg):
                tensor_indices.append(i)
                tensors.append(arg)
            others.append(None if torch.is_tensor(arg) else arg)
        ctx.distribute_first = (
            bool(distribute_saved_activations)
            and get_tensor_model_parallel_world_size() > 1
            and 0 in tensor_indices
            and tensors[0].numel() % get_tensor_model_parallel_world_size() == 0
        )
        if ctx.distribute_first:
            ctx.first_shape = tensors[0].shape
            tensors[0] = _split_1d_own_chunk(tensors[0].detach())
        ctx.tensor_indices = tensor_indices
        ctx.others = others
        ctx.requires_grad_flags = [torch.is_tensor(a) and a.requires_grad for a in args]
        ctx.save_for_backward(*tensors)
        return outputs

    @staticmethod
    def backward(ctx, *grad_outputs):
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("Checkpointing is not compatible with .grad(), please use .backward() if possible")
        saved = list(ctx.saved_tensors)
        if ctx.distribute_first:
            saved[0] = _gather_1d_chunks(saved[0], ctx.first_shape)
        args = list(ctx.others)
        for index, tensor in zip(ctx.tensor_indices, saved):
            detached = tensor.detach()
            detached.requires_grad_(ctx.requires_grad_flags[index])
            args[index] = detached

        # Replay with the forward-time RNG states, then put the current ones back.
        bwd_cpu_rng_state = torch.get_rng_state()
        bwd_cuda_rng_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        tracker = get_cuda_rng_tracker()
        bwd_tracker_states = tracker.get_states()
        torch.set_rng_state(ctx.fwd_cpu_rng_state)
        if ctx.fwd_cuda_rng_state is not None:
            torch.cuda.set_rng_state(ctx.fwd_cuda_rng_state)
        tracker.set_states(ctx.fwd_tracker_states)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*args)
        finally:
            torch.set_rng_state(bwd_cpu_rng_state)
            if bwd_cuda_rng_state is not None:
                torch.cuda.set_rng_state(bwd_cuda_rng_state)
            tracker.set_states(bwd_tracker_states)

        if torch.is_tensor(outputs):
            outputs = (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grad_outputs)
                 if torch.is_tensor(out) and out.requires_grad and grad is not None]
        if pairs:
            torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        grads = tuple(a.grad if torch.is_tensor(a) else None for a in args)
        return (None, None) + grads


def checkpoint(function, distribute_saved_activations: bool, *args: Any):
    """Recompute ``function(*args)`` in backward instead of storing its activations.

    Tensor outputs get gradients as usual; non-tensor arguments are passed through unchanged.
    """
    return CheckpointFunction.apply(function, distribute_saved_activations, *args)
