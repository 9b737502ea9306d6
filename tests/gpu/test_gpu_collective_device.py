"""On a GPU: every package collective runs over a real NCCL group, whose tensors must live on CUDA."""
import pytest
import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.collective_device import get_collective_device
from megatron.core.optimizer.clip_grads import count_zeros_fp32, get_grad_norm_fp32
from megatron.core.timers import Timers

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()),
    reason="needs a CUDA GPU and a PyTorch build with NCCL",
)


@pytest.fixture
def nccl_world(tmp_path):
    """A one-rank NCCL default group bound to cuda:0, as initialize_megatron builds it."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_nccl_collectives_run_on_cuda(nccl_world):
    from megatron.training import checkpointing

    assert get_collective_device() == torch.device("cuda", 0)
    registry = Timers(log_level=2)
    registry("step", log_level=0).start()
    registry("step").stop()
    assert "step" in registry.get_all_timers_string(["step"], barrier=True)
    assert checkpointing._any_rank(True) is True
    assert checkpointing._broadcast_int_from_rank_0(7) == 7

    parallel_state.initialize_model_parallel()
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    gloo = parallel_state.get_data_parallel_group_gloo()
    assert get_collective_device(gloo) == torch.device("cpu")
    cpu_value = torch.ones(1)
    dist.all_reduce(cpu_value, group=gloo)
    assert cpu_value.item() == 1.0

    param = torch.nn.Parameter(torch.zeros(4, device="cuda"))
    param.grad = torch.tensor([3.0, 4.0, 0.0, 0.0], device="cuda")
    assert get_grad_norm_fp32([param.grad], model_parallel_group=parallel_state.get_model_parallel_group()) == \
        pytest.approx(5.0)
    assert count_zeros_fp32([param], grad_stats_parallel_group=parallel_state.get_model_parallel_group()) == 2
