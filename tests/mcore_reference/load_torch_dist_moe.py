"""Load a torch_dist MoE checkpoint into real megatron-core 0.14's GPTModel and optimizer (the MoE fixture's model).

Run with the unpacked megatron-core 0.14.0 wheel on the path and never with this project's ``megatron`` package
(both have that name)::

    PYTHONPATH=$MCORE_V014_PATH python tests/mcore_reference/load_torch_dist_moe.py VARIANT ITER_DIR OUT.pt \
        [--distributed-optimizer]

VARIANT is ``mixtral`` or ``shared``: the model of tests/data/mcore_v014/moe/generate_moe.py (built by that module,
whose CPU shims it reuses: Megatron-LM's ``get_gpt_decoder_block_spec`` local MoE spec, SequentialMLP experts).
It asks model and Adam (``get_megatron_optimizer``; the distributed optimizer with ``--distributed-optimizer``)
for their sharded state dict, reads ITER_DIR with ``megatron.core.dist_checkpointing.load`` (Megatron's own key,
shape and metadata checks), loads the result and writes to OUT.pt: ``logits`` for the variant's reference.pt batch,
``names`` / ``exp_avg_norm`` / ``exp_avg_sq_norm`` per parameter (Megatron's names, float64) and the
``expert_bias`` buffers. One process, a one-rank gloo group, CPU.
"""
import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "data", "mcore_v014", "moe"))
import cpu_stand_ins  # noqa: E402  (beside this file)

cpu_stand_ins.install()
import generate_moe  # noqa: E402  (its module import applies generate.py's shims and the te_general_gemm one)

from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402

cpu_stand_ins.patch_megatron()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("variant", choices=sorted(generate_moe.VARIANTS))
    parser.add_argument("iteration_dir")
    parser.add_argument("out")
    parser.add_argument("--distributed-optimizer", action="store_true")
    args = parser.parse_args()

    generate_moe.base.init_distributed()
    torch.manual_seed(0)
    distributed = args.distributed_optimizer
    ddp, config = generate_moe.build_model(args.variant)
    model = ddp.module
    if distributed:  # the module again, in a DistributedDataParallel for the distributed optimizer
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1, clip_grad=0.0,
                                                       use_distributed_optimizer=distributed), [ddp])
    if distributed:
        for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
            sub.init_state_fn(sub.optimizer, sub.config)
            for state in sub.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))
    metadata = {"distrib_optim_sharding_type": "fully_sharded_model_space"} if distributed else {}
    metadata.update(singleton_local_shards=False, chained_optim_avoid_prefix=True)
    model_sd = model.sharded_state_dict(metadata=metadata)
    state_dict = {"model": model_sd,
                  "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=True, metadata=metadata)}
    loaded = dist_checkpointing.load(state_dict, args.iteration_dir)
    model.load_state_dict(loaded["model"])
    optimizer.load_state_dict(loaded["optimizer"])

    reference = torch.load(os.path.join(HERE, "..", "data", "mcore_v014", "moe", args.variant, "reference.pt"),
                           weights_only=True)
    seq = generate_moe.SEQ
    mask = torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq) < 0.5
    model.eval()
    with torch.no_grad():
        logits = model(reference["input_ids"], reference["position_ids"], mask)
    names, exp_avg, exp_avg_sq = [], [], []
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    for name, param in model.named_parameters():
        for sub in subs:
            if distributed and param in sub.model_param_group_index_map:
                state = sub._get_main_param_and_optimizer_states(param)
                break
            if not distributed and param in sub.optimizer.state:
                state = sub.optimizer.state[param]
                break
        else:
            raise KeyError(f"{name}: no optimizer state")
        names.append(name)
        exp_avg.append(state["exp_avg"].double().norm())
        exp_avg_sq.append(state["exp_avg_sq"].double().norm())
    biases = {name: value.clone() for name, value in model.named_buffers() if name.endswith("expert_bias")}
    torch.save({"logits": logits, "names": names, "exp_avg_norm": torch.stack(exp_avg),
                "exp_avg_sq_norm": torch.stack(exp_avg_sq), "expert_bias": biases}, args.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
