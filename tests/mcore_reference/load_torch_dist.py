"""Load a torch_dist checkpoint into real megatron-core 0.14's local-spec GPTModel and optimizer.

Run with the unpacked megatron-core 0.14.0 wheel on the path and never with this project's
``megatron`` package (both have that name)::

    PYTHONPATH=$MCORE_V014_PATH python tests/mcore_reference/load_torch_dist.py ITER_DIR REFERENCE.pt OUT.pt \
        [--distributed-optimizer]

It builds the model of tests/data/mcore_v014 (2 layers, hidden 32, 4 heads, padded vocabulary
1024, sequence 32, tied embeddings) wrapped in megatron.core's DistributedDataParallel, Adam from
get_megatron_optimizer, asks both for their sharded state dict, reads ITER_DIR with
``megatron.core.dist_checkpointing.load`` (Megatron's own key, shape and metadata checks), loads
the result into model and optimizer and writes to OUT.pt: ``logits`` for REFERENCE.pt's
``input_ids``/``position_ids`` (causal mask) and ``names`` / ``exp_avg_norm`` / ``exp_avg_sq_norm``
per parameter (Megatron's per-layer names, float64). One process, a one-rank gloo group, CPU.
"""
import argparse
import os

import torch

import cpu_stand_ins  # noqa: E402  (beside this file: the script directory is on sys.path)

cpu_stand_ins.install()

import torch.distributed as dist  # noqa: E402

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

cpu_stand_ins.patch_megatron()

SEQ, HIDDEN, HEADS, LAYERS, PADDED_VOCAB = 32, 32, 4, 2, 1024


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("iteration_dir")
    parser.add_argument("reference")
    parser.add_argument("out")
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    parallel_state.initialize_model_parallel()
    torch.manual_seed(0)
    config = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN,
                               num_attention_heads=HEADS, attention_dropout=0.0, hidden_dropout=0.0,
                               use_cpu_initialization=True, params_dtype=torch.float32, normalization="LayerNorm",
                               masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
                               gradient_accumulation_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=PADDED_VOCAB, max_sequence_length=SEQ,
                     share_embeddings_and_output_weights=True, position_embedding_type="learned_absolute")
    distributed = args.distributed_optimizer
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=distributed), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0,
                                                       use_distributed_optimizer=distributed), [ddp])
    if distributed:
        # Without Apex/TE, DistributedOptimizer.state_dict() reads Adam's step from existing state (after
        # a first step); give the fresh state a placeholder step: the checkpoint's values replace it.
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            sub.init_state_fn(sub.optimizer, sub.config)
            for state in sub.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
    metadata = {"distrib_optim_sharding_type": "fully_sharded_model_space"} if distributed else None
    model_sd = model.sharded_state_dict(metadata=metadata)
    state_dict = {"model": model_sd,
                  "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    loaded = dist_checkpointing.load(state_dict, args.iteration_dir)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])

    reference = torch.load(args.reference, weights_only=True)
    mask = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ) < 0.5
    model.eval()
    with torch.no_grad():
        logits = model(reference["input_ids"], reference["position_ids"], mask)
    names, exp_avg, exp_avg_sq = [], [], []
    for name, param in model.named_parameters():
        sub = getattr(optimizer, "chained_optimizers", [optimizer])[0]
        state = sub._get_main_param_and_optimizer_states(param) if distributed else sub.optimizer.state[param]
        names.append(name)
        exp_avg.append(state["exp_avg"].double().norm())
        exp_avg_sq.append(state["exp_avg_sq"].double().norm())
    torch.save({"logits": logits, "names": names, "exp_avg_norm": torch.stack(exp_avg),
                "exp_avg_sq_norm": torch.stack(exp_avg_sq)}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
