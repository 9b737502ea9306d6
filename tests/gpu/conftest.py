"""Fixture of the GPU tests: a one-rank NCCL process group with Megatron's parallel groups on it.

Every test under tests/gpu is skipped without CUDA (the CPU CI collects them and skips at once);
``bash bench/gpu.sh`` runs them on a GPU machine.
"""
import pytest
import torch

from gpu_utils import NO_CUDA_REASON, free_port


@pytest.fixture(scope="session")
def nccl_group():
    """A one-rank NCCL default process group on cuda:0 with Megatron's parallel groups built on it.

    Collectives over it run NCCL kernels on CUDA tensors, as on a cluster; a CPU tensor there fails
    (an NCCL group has no CPU backend), which is exactly what these tests must not hit.
    """
    import torch.distributed as dist

    from megatron.core import parallel_state

    if not torch.cuda.is_available():
        pytest.skip(NO_CUDA_REASON)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    yield dist.group.WORLD
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
