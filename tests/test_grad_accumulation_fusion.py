"""Fused weight-grad accumulation into main_grad gives the same grads as plain autograd, tied embeddings included.

fp32: equal to fp32 rounding. bf16 with an fp32 main_grad (Megatron's --bf16 default): the fused path
never upcasts the activations; it agrees with the unfused path within bf16 rounding.
"""
import torch

from dist_utils import run_distributed


def _main_grads(fusion, share, bf16=False):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, hidden_dropout=0.0,
                               attention_dropout=0.0, gradient_accumulation_fusion=fusion, bf16=bf16)
    model = GPTModel(config, vocab_size=64, max_sequence_length=8, share_embeddings_and_output_weights=share)
    if bf16:
        model = Float16Module(config, model)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(grad_reduce_in_fp32=bf16), model)
    tokens = torch.randint(0, 64, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    for _ in range(2):  # two microbatches accumulate
        with ddp.no_sync():
            ddp(tokens, positions, None, labels=tokens).mean().backward()
    ddp.finish_grad_sync()
    return {name: p.main_grad.clone() for name, p in model.named_parameters()}


def _all_variants(rank, world_size, bf16=False):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    return {(fusion, share): _main_grads(fusion, share, bf16)
            for fusion in (False, True) for share in (False, True)}


def test_fused_and_unfused_grads_agree():
    grads = run_distributed(_all_variants, 1)[0]
    for share in (True, False):
        plain, fused = grads[(False, share)], grads[(True, share)]
        assert plain.keys() == fused.keys()
        for name in plain:
            assert plain[name].abs().sum() > 0, name
            torch.testing.assert_close(fused[name], plain[name], rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_fused_and_unfused_grads_agree_in_fp32_main_grad():
    grads = run_distributed(_all_variants, 1, True)[0]
    eps = torch.finfo(torch.bfloat16).eps
    for share in (True, False):
        plain, fused = grads[(False, share)], grads[(True, share)]
        assert plain.keys() == fused.keys()
        for name in plain:
            assert fused[name].dtype == torch.float32, name
            assert plain[name].abs().sum() > 0, name
            # Two micro-batches, each product rounded to bf16 at most once more on one side.
            scale = plain[name].abs().max().item()
            torch.testing.assert_close(fused[name], plain[name], rtol=2 * eps, atol=2 * eps * scale, msg=name)
