"""Simulate one data-parallel rank of a 7B GPT at DP=8, 64, 512 on the fake process group and print its
optimizer bytes, measured from the optimizer's tensors, against Megatron's theoretical memory formula.

No memory is spent on the model: the parameters live on the ``meta`` device, and the real
``DistributedDataParallel`` buffers, bucket padding, (distributed) optimizer sharding and Adam states
are built on top of them, so the measured bytes are those a real rank would hold.

    python bench/bench_memory_report.py                  # Llama-2-7B shape, bf16, Adam
    python bench/bench_memory_report.py --dp 8 64 --rank 0
"""
import argparse
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_optimizer_state_bytes  # noqa: E402
from megatron.core.transformer import TransformerConfig  # noqa: E402
from megatron.training.theoretical_memory_usage import (  # noqa: E402
    NUM_BYTES_IN_MEGABYTE,
    bytes_per_parameter,
    compute_weight_and_optimizer_memory,
    gpt_parameter_shapes,
)

# Adam's fp32 main param + exp_avg + exp_avg_sq: Megatron's 12 of its 18 bytes per parameter.
OPTIMIZER_BYTES_PER_PARAM = 12


def llama2_7b_args(data_parallel_size: int, use_distributed_optimizer: bool, **overrides) -> SimpleNamespace:
    """The command-line values of Llama-2-7B (6.74e9 parameters) trained with --bf16 and Adam."""
    args = SimpleNamespace(
        num_layers=32, hidden_size=4096, num_attention_heads=32, kv_channels=128, group_query_attention=False,
        num_query_groups=32, ffn_hidden_size=11008, swiglu=True, normalization="RMSNorm", add_bias_linear=False,
        add_qkv_bias=False, qk_layernorm=False, position_embedding_type="rope", max_position_embeddings=4096,
        padded_vocab_size=32000, untie_embeddings_and_output_weights=True, tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1, context_parallel_size=1, data_parallel_size=data_parallel_size,
        bf16=True, fp16=False, accumulate_allreduce_grads_in_fp32=True, optimizer="adam", sgd_momentum=0.9,
        use_distributed_optimizer=use_distributed_optimizer, overlap_grad_reduce=True, ddp_bucket_size=None,
        sequence_parallel=False, recompute_granularity=None,
    )
    for key, value in overrides.items():
        setattr(args, key, value)
    return args


def _meta_module(shapes, dtype) -> torch.nn.Module:
    """A module tree whose ``named_parameters()`` are ``shapes`` (names kept), on the meta device."""
    root = torch.nn.Module()
    for name, shape in shapes:
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(torch.empty(shape, dtype=dtype, device="meta")))
    return root


def simulate_rank(args, rank: int) -> dict:
    """Build rank ``rank`` of ``tp * pp * dp`` fake ranks and measure its optimizer state.

    Returns a dict: ``dp`` (the data-parallel group size the rank sees), ``params`` (parameters on
    the rank), ``measured`` (bytes, :func:`get_optimizer_state_bytes`), ``formula`` (bytes, the
    report's optimizer part), ``padding`` (bytes the grad buffers' padding can shift between shards:
    padded minus real elements times 12), ``buckets``, ``tensors`` (parameter tensors on the rank).
    """
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    world = tp * pp * args.data_parallel_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        pp_rank = parallel_state.get_pipeline_model_parallel_rank()
        dtype = torch.bfloat16 if args.bf16 else (torch.float16 if args.fp16 else torch.float32)
        module = _meta_module(gpt_parameter_shapes(args, pp_rank), dtype)
        config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, bf16=args.bf16,
                                   fp16=args.fp16, params_dtype=dtype)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32, overlap_grad_reduce=args.overlap_grad_reduce,
            use_distributed_optimizer=args.use_distributed_optimizer, bucket_size=args.ddp_bucket_size)
        model = DistributedDataParallel(config, ddp_config, module)
        optimizer = get_megatron_optimizer(
            OptimizerConfig(lr=1e-4, bf16=args.bf16, fp16=args.fp16, optimizer=args.optimizer,
                            use_distributed_optimizer=args.use_distributed_optimizer), [model])
        optimizer.init_state_fn(optimizer.optimizer)  # Adam's states, as the first step would create them
        per = bytes_per_parameter(args)
        padded = sum(buffer.grad_data.numel() - buffer.numel_unpadded for buffer in model.buffers)
        return {
            "dp": parallel_state.get_data_parallel_world_size(with_context_parallel=True),
            "params": sum(p.numel() for p in module.parameters()),
            "measured": get_optimizer_state_bytes(optimizer),
            "formula": compute_weight_and_optimizer_memory(args, pp_rank=pp_rank).optimizer_bytes,
            "padding": padded * (per.main_param + per.optimizer_state),
            "buckets": sum(len(buffer.buckets) for buffer in model.buffers),
            "tensors": len(list(module.parameters())),
        }
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dp", type=int, nargs="+", default=[8, 64, 512], help="data-parallel sizes")
    parser.add_argument("--rank", type=int, default=None, help="global rank to simulate (default: the last)")
    options = parser.parse_args()
    print("Llama-2-7B shape (32 layers, hidden 4096, SwiGLU 11008, vocab 32000, untied), --bf16, Adam, "
          "fp32 grads; one rank on the fake process group, params on the meta device")
    print(f"{'DP':>5} {'dist-opt':>8} {'params/rank':>13} {'buckets':>7} {'measured MB':>12} "
          f"{'formula MB':>11} {'meas/formula':>12} {'bytes/param (Megatron)':>23}")
    for dp in options.dp:
        for distributed in (False, True):
            args = llama2_7b_args(dp, distributed)
            result = simulate_rank(args, dp - 1 if options.rank is None else options.rank)
            ratio = result["measured"] / result["formula"]
            megatron = 18 if not distributed else 6 + 12 / dp
            measured_mb, formula_mb = (result[key] / NUM_BYTES_IN_MEGABYTE for key in ("measured", "formula"))
            print(f"{dp:5d} {str(distributed):>8} {result['params']:13d} {result['buckets']:7d} "
                  f"{measured_mb:12.2f} {formula_mb:11.2f} {ratio:12.6f} {megatron:23.4f}")
            footprint = compute_weight_and_optimizer_memory(args)
            print(f"      Theoretical memory footprints: weight and optimizer="
                  f"{footprint.weight_and_optimizer_bytes / NUM_BYTES_IN_MEGABYTE:.2f} MB")


if __name__ == "__main__":
    main()
