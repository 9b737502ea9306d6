"""GPTModel on one GPU: fp32 on CUDA equals fp32 on the CPU, and bf16 forward/backward stays within bf16 of fp32."""
import pytest
import torch

from gpu_utils import relative_error, requires_cuda, small_gpt_config

pytestmark = requires_cuda

V, S, B = 512, 64, 4


def _gpt(cfg, seed=0):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(cfg, vocab_size=V, max_sequence_length=S, share_embeddings_and_output_weights=True)


def _batch(device):
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, V, (B, S), generator=g)
    labels = torch.randint(0, V, (B, S), generator=g)
    positions = torch.arange(S).expand(B, S)
    return ids.to(device), positions.to(device), labels.to(device)


def _loss_and_grads(model, device):
    """Per-token loss [b, s] (fp32) of one batch and every parameter's gradient as fp32 on the CPU."""
    ids, positions, labels = _batch(device)
    loss = model(ids, positions, None, labels=labels)
    loss.float().mean().backward()
    grads = {name: p.grad.float().cpu() for name, p in model.named_parameters()}
    return loss.detach().float().cpu(), grads


@pytest.fixture
def no_tf32():
    """fp32 matmuls in full fp32 (PyTorch's default; a container may have switched TF32 on)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_fp32_on_cuda_matches_cpu(no_tf32):
    cpu_model = _gpt(small_gpt_config())
    gpu_model = _gpt(small_gpt_config())
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model.cuda()
    assert next(gpu_model.parameters()).is_cuda
    cpu_loss, cpu_grads = _loss_and_grads(cpu_model, "cpu")
    gpu_loss, gpu_grads = _loss_and_grads(gpu_model, "cuda")
    assert relative_error(gpu_loss, cpu_loss) < 1e-3
    for name, ref in cpu_grads.items():
        assert ref.abs().sum() > 0, name
        assert relative_error(gpu_grads[name], ref) < 1e-3, name


def test_bf16_forward_backward_matches_fp32(no_tf32):
    """bf16 parameters and activations (as ``--bf16`` trains) against the same weights in fp32.

    Tolerances are bf16's: one bf16 rounding is 2^-9 relative. The same check with bf16 on the CPU
    gives 2e-4 on the loss, at most 2e-2 on one parameter's gradient and 7e-3 over all of them; a
    wrong cast or an overflow gives O(1).
    """
    fp32 = _gpt(small_gpt_config()).cuda()
    bf16 = _gpt(small_gpt_config(bf16=True, params_dtype=torch.bfloat16))
    bf16.load_state_dict(fp32.state_dict())
    bf16.cuda()
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    ref_loss, ref_grads = _loss_and_grads(fp32, "cuda")
    loss, grads = _loss_and_grads(bf16, "cuda")
    assert torch.isfinite(loss).all()
    assert abs(loss.mean().item() - ref_loss.mean().item()) / ref_loss.mean().item() < 1e-2
    assert relative_error(loss, ref_loss) < 2e-2
    for name, ref in ref_grads.items():
        assert torch.isfinite(grads[name]).all(), name
        assert relative_error(grads[name], ref) < 1e-1, name
    everything = lambda g: torch.cat([t.flatten() for t in g.values()])  # noqa: E731
    assert relative_error(everything(grads), everything(ref_grads)) < 3e-2
