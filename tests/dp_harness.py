"""In-process data-parallel training of a tiny GPT: several DDP / optimizer layouts in one launch of the ranks.

``train_layouts(rank, world, layouts)`` is run on every rank by ``dist_utils.run_distributed``; each
layout re-initialises parallel_state, builds the same GPT (same seed, TP-invariant init), wraps it in
DistributedDataParallel with the layout's options and trains ``iters`` fp32 iterations on the same
global batches (each data-parallel rank takes its slice, in micro-batches of ``MBS``).
"""
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer, get_optimizer_state_bytes
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer import TransformerConfig

V, S, GBS, MBS, LR = 128, 16, 8, 2, 3e-3


def build(tp: int, seed: int = 7) -> GPTModel:
    """A 2-layer, hidden-32 GPT-2-like model (tied embeddings, learned positions), no dropout."""
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    return GPTModel(config, vocab_size=V, max_sequence_length=S, share_embeddings_and_output_weights=True,
                    position_embedding_type="learned_absolute")


def global_batch(iteration: int) -> torch.Tensor:
    """``[GBS, S + 1]`` token ids of one iteration (the same on every rank and layout).

    Each sequence counts up from a random start by a random stride of 1..3 (mod V): learnable, so the
    loss falls and the comparison covers a model that actually changes.
    """
    g = torch.Generator().manual_seed(1000 + iteration)
    start = torch.randint(0, V, (GBS, 1), generator=g)
    stride = torch.randint(1, 4, (GBS, 1), generator=g)
    return (start + stride * torch.arange(S + 1)) % V


def _forward_step(data_iterator, model):
    tokens = next(data_iterator)
    position_ids = torch.arange(S).expand(tokens.shape[0], S)
    losses = model(tokens[:, :-1], position_ids, None, labels=tokens[:, 1:])

    def loss_func(output):
        loss = output.float().sum()
        num_tokens = torch.tensor(output.numel(), dtype=torch.int)
        return loss, num_tokens, {"lm loss": torch.stack([loss.detach(), num_tokens.float()])}

    return losses, loss_func


def make(layout: dict):
    """(DDP chunk, optimizer) for ``layout`` after parallel_state was initialised."""
    module = build(layout.get("tp", 1))
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=layout.get("overlap_grad_reduce", False),
        overlap_param_gather=layout.get("overlap_param_gather", False),
        use_distributed_optimizer=layout.get("distopt", False),
        bucket_size=layout.get("bucket_size"),
    )
    model = DistributedDataParallel(module.config, ddp_config, module)
    model.broadcast_params()
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=LR, weight_decay=0.01, clip_grad=layout.get("clip_grad", 1.0),
                        use_distributed_optimizer=layout.get("distopt", False)), [model])
    module.config.grad_scale_func = optimizer.scale_loss
    module.config.finalize_model_grads_func = finalize_model_grads
    module.config.no_sync_func = model.no_sync
    return model, optimizer


def train_steps(model, optimizer, first: int, last: int):
    """Iterations ``first..last`` (1-based, inclusive); returns (losses, grad norms)."""
    dp = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    per_rank = GBS // dp
    losses, norms = [], []
    for iteration in range(first, last + 1):
        tokens = global_batch(iteration)[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        micro = iter(tokens.split(MBS))
        model.zero_grad_buffer()
        optimizer.zero_grad()
        reports = get_forward_backward_func()(
            forward_step_func=_forward_step, data_iterator=micro, model=[model], num_microbatches=per_rank // MBS,
            seq_length=S, micro_batch_size=MBS, forward_only=False)
        ok, grad_norm, _ = optimizer.step()
        assert ok
        total = torch.stack([r["lm loss"] for r in reports]).sum(0)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        losses.append((total[0] / total[1]).item())
        norms.append(grad_norm)
    return losses, norms


def train_layouts(rank: int, world: int, layouts: list, iters: int = 20) -> list:
    """Per layout: {'loss', 'grad_norm': per iteration; 'state_bytes': get_optimizer_state_bytes;
    'moment_bytes': bytes of Adam's exp_avg/exp_avg_sq; 'padding': buffer elements no param uses;
    'num_buckets'}."""
    results = []
    for layout in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=layout.get("tp", 1))
        try:
            model, optimizer = make(layout)
            losses, norms = train_steps(model, optimizer, 1, iters)
            buffers = model.buffers
            moments = [t for state in optimizer.optimizer.state.values() for k, t in state.items()
                       if k in ("exp_avg", "exp_avg_sq")]
            results.append(dict(
                loss=losses, grad_norm=norms, state_bytes=get_optimizer_state_bytes(optimizer),
                moment_bytes=sum(t.numel() * t.element_size() for t in moments),
                padding=sum(buf.grad_data.numel() for buf in buffers) - sum(p.numel() for p in model.parameters()),
                num_buckets=sum(len(buf.buckets) for buf in buffers),
            ))
        finally:
            ps.destroy_model_parallel()
    return results
