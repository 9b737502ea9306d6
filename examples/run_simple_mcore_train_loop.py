"""Minimal training loop on ``megatron.core`` alone (no argument system), with the built-in telemetry.

The first setup Megatron's observability documentation walks through: a tiny GPT on mock data, trained
with ``get_forward_backward_func`` and Adam, spans and metrics through ``megatron.core.telemetry``.

    python examples/run_simple_mcore_train_loop.py                            # one process (CPU or one GPU)
    torchrun --nproc-per-node 2 examples/run_simple_mcore_train_loop.py --tp 2
    MEGATRON_OTEL_ENABLED=1 MEGATRON_OTEL_EXPORTER=console python examples/run_simple_mcore_train_loop.py

With ``MEGATRON_OTEL_EXPORTER=console`` every span and metric snapshot is one JSON object per line on
stdout; with the default ``otlp`` they go to ``OTEL_EXPORTER_OTLP_ENDPOINT`` (see ``observability/``).
"""
import argparse
import os
from functools import partial

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core import telemetry
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.tokenizers.null_tokenizer import NullTokenizer
from megatron.core.transformer.transformer_config import TransformerConfig

SEQUENCE_LENGTH = 64
VOCAB_SIZE = 256


def initialize_distributed(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1):
    """Join the process group (torchrun's variables, or a one-process group) and build the parallel groups."""
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size, pipeline_model_parallel_size)


def model_provider() -> GPTModel:
    """A 2-layer GPT, hidden 64, 4 heads, learned absolute positions."""
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                               pipeline_dtype=torch.float32,
                               tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size())
    return GPTModel(config=config, vocab_size=VOCAB_SIZE, max_sequence_length=SEQUENCE_LENGTH)


def get_train_data_iterator(batch_size: int, num_samples: int):
    """Mock GPT samples ({tokens, labels, loss_mask, position_ids, attention_mask}), ``batch_size`` per batch."""
    config = GPTDatasetConfig(random_seed=0, sequence_length=SEQUENCE_LENGTH, reset_position_ids=False,
                              reset_attention_mask=False, eod_mask_loss=False,
                              tokenizer=NullTokenizer(vocab_size=VOCAB_SIZE - 1), mock=True)
    train, _, _ = BlendedMegatronDatasetBuilder(MockGPTDataset, [num_samples, None, None], lambda: True,
                                                config).build()
    loader = torch.utils.data.DataLoader(train, batch_size=batch_size, shuffle=False)
    return iter(loader)


def forward_step_func(data_iterator, model):
    """One microbatch: returns the per-token losses and how to reduce them (``(loss, num_tokens, report)``)."""

    def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
        losses = output_tensor.float().view(-1)
        mask = loss_mask.view(-1).float()
        total = torch.sum(losses * mask)
        num_tokens = mask.sum().to(torch.int)
        return total, num_tokens, {"lm loss": torch.stack([total.detach(), num_tokens.float()])}

    device = next(model.parameters()).device
    batch = {key: value.to(device) for key, value in next(data_iterator).items()}
    output = model(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
    return output, partial(loss_func, batch["loss_mask"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    parser.add_argument("--iters", type=int, default=5, help="training iterations")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--num-microbatches", type=int, default=2)
    args = parser.parse_args()

    initialize_distributed(tensor_model_parallel_size=args.tp)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # MEGATRON_OTEL_* / NEMO_LENS_* variables; a no-op handle when MEGATRON_OTEL_ENABLED is not set.
    handle = telemetry.setup_telemetry(telemetry.TelemetryConfig.from_env(), rank, world_size,
                                       {"dl.tensor_parallel.size": args.tp})
    model_parallel_cuda_manual_seed(123)

    model = model_provider()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    model.to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    data_parallel_size = parallel_state.get_data_parallel_world_size()
    samples = args.iters * args.num_microbatches * args.micro_batch_size * data_parallel_size
    data_iterator = get_train_data_iterator(args.micro_batch_size, samples)
    forward_backward_func = get_forward_backward_func()

    with telemetry.managed_span("job", "megatron.train", **{"megatron.train_iters": args.iters}):
        for iteration in range(1, args.iters + 1):
            with telemetry.managed_span("step", "megatron.train_step", **{"megatron.iteration": iteration}) as span:
                optimizer.zero_grad()
                reports = forward_backward_func(
                    forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                    num_microbatches=args.num_microbatches, seq_length=SEQUENCE_LENGTH,
                    micro_batch_size=args.micro_batch_size, forward_only=False)
                with telemetry.managed_span("optimizer", "megatron.optimizer_step"):
                    optimizer.step()
                totals = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
                loss = (totals[0] / totals[1]).item()
                telemetry.safe_set_span_attributes(span, {"megatron.loss": loss})
            telemetry.record_training_metrics(handle.meter, loss=loss, iteration=iteration)
            if rank == 0:
                print(f"iteration {iteration:3d}/{args.iters} | lm loss: {loss:.6E}", flush=True)

    handle.shutdown()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
