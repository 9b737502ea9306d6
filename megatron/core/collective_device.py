"""The one place that decides which device a collective's tensors live on, from the group's backend."""
from typing import Dict

import torch
import torch.distributed as dist

# Backends that carry collectives through host memory. Gloo lists "cuda" in its device map, but it
# only stages CUDA tensors through the host and lacks some CUDA collectives (reduce_scatter), so
# its tensors belong on the CPU.
_HOST_BACKENDS = frozenset({"gloo", "mpi"})


def device_backend_map(group=None) -> Dict[str, str]:
    """``{device type: backend}`` served by ``group`` (the default group when None).

    E.g. ``{"cuda": "nccl"}`` for NCCL, ``{"cpu": "gloo", "cuda": "gloo"}`` for gloo,
    ``{"cpu": "gloo", "cuda": "nccl"}`` for ``init_process_group("cpu:gloo,cuda:nccl")``.

    Raises:
        ValueError / RuntimeError (from torch): ``group`` is not a group this rank belongs to.
    """
    query = getattr(dist, "get_backend_config", None) or dist.get_backend  # get_backend_config: torch >= 2.3
    config = str(query(group))
    backend_map = {}
    for entry in config.split(","):
        device, _, backend = entry.strip().rpartition(":")
        if device:
            backend_map[device.strip().lower()] = backend.strip().lower()
        else:
            # A bare backend name ("nccl"): ask torch which devices it registered for.
            from torch.distributed.distributed_c10d import Backend, BackendConfig

            backend_map.update(BackendConfig(Backend(backend)).get_device_backend_map())
    return backend_map


def get_collective_device(group=None) -> torch.device:
    """Device on which to build the tensors passed to a ``torch.distributed`` collective on ``group``.

    Decided from the backend of ``group`` (the default group when None), never from what hardware
    happens to be present, because a backend only moves tensors of the devices it serves: an NCCL
    group has no CPU backend (``{"cuda": "nccl"}``) and gloo is a CPU transport.

    - NCCL (or any non-host backend serving ``cuda``): ``cuda:<torch.cuda.current_device()>``.
    - A group serving both (``cpu:gloo,cuda:nccl``, the test-only ``fake`` backend): the CUDA
      device when CUDA is available (keeps the tensor next to the model), else the CPU.
    - gloo (and other host backends): the CPU.
    - torch.distributed not available or not initialised (a single process without any process
      group): the current CUDA device when CUDA is available, else the CPU.

    Tensors computed elsewhere (a loss on the model's device) are moved with ``.to(device)``,
    which is free when they already live there.

    Raises:
        ValueError: the backend serves neither ``cpu`` nor ``cuda`` (names the backend map).
        ValueError / RuntimeError (from torch): ``group`` is not a group this rank belongs to.
    """
    if not (dist.is_available() and dist.is_initialized()):
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    backend_map = device_backend_map(group)
    cuda_backend = backend_map.get("cuda")
    cuda_native = cuda_backend is not None and cuda_backend not in _HOST_BACKENDS
    if cuda_native and ("cpu" not in backend_map or torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    if "cpu" in backend_map:
        return torch.device("cpu")
    raise ValueError(
        f"process group backend {backend_map} serves neither 'cpu' nor 'cuda'; "
        "no device for a collective's tensors"
    )
