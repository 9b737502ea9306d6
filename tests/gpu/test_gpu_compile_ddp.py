"""CUDA: the bf16 GPT model wrapped as pretrain_gpt.py wraps it (DDP, fp32 grad buffer, fused wgrad into
main_grad, bias-GeLU and bias-dropout-add fusions) compiles with inductor in one graph, and its main_grads
equal eager's within bf16 rounding."""
import pytest
import torch

from gpu_utils import relative_error, small_gpt_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

V, S, B = 256, 64, 2


def _ddp_model():
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    config = small_gpt_config(bf16=True, gradient_accumulation_fusion=True, bias_activation_fusion=True,
                              bias_dropout_fusion=True)
    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    model = Float16Module(config, GPTModel(config, vocab_size=V, max_sequence_length=S)).cuda()
    return DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, V, (B, S), generator=g).cuda()
    return ids, torch.arange(S, device="cuda").expand(B, S), ids.roll(-1, dims=1)


def test_cuda_ddp_model_compiles_whole_and_matches_eager(nccl_group):
    ids, pos, labels = _batch()
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(_ddp_model())(ids, pos, None, labels=labels)
    assert explanation.graph_break_count == 0, [b.reason.splitlines()[0] for b in explanation.break_reasons]

    grads = []
    for compiled in (False, True):
        torch._dynamo.reset()
        ddp = _ddp_model()
        run = torch.compile(ddp) if compiled else ddp
        ddp.zero_grad_buffer()
        run(ids, pos, None, labels=labels).float().mean().backward()
        ddp.finish_grad_sync()
        grads.append({name: p.main_grad.clone() for name, p in ddp.module.named_parameters()})
    eager, compiled = grads
    for name, grad in eager.items():
        assert compiled[name].dtype == torch.float32
        assert relative_error(compiled[name], grad) < 2e-2, name
