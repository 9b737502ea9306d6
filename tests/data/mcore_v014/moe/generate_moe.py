"""Write the megatron-core 0.14.0 MoE checkpoints under tests/data/mcore_v014/moe/ with the real megatron-core.

Run it exactly as ``../generate.py`` (whose CPU shims, args Namespace, RNG-state and tracker helpers it
imports), with the unpacked megatron-core==0.14.0 wheel first on the path and never this project's
``megatron`` package::

    PYTHONPATH=/path/to/unpacked/megatron_core-0.14.0 python tests/data/mcore_v014/moe/generate_moe.py [OUT_DIR]

Two models, both the GPTModel Megatron-LM's ``pretrain_gpt.py`` builds for ``--num-experts`` with
``--transformer-impl local``: ``get_gpt_decoder_block_spec(config, use_transformer_engine=False)``
(SequentialMLP experts over local linears, allgather dispatcher), one gloo rank on the CPU, fp32, dropout 0,
RMSNorm, SwiGLU, RoPE, untied embeddings, no linear biases, ``--vocab-size 100`` (padded to 128),
``--hidden-size 16 --num-attention-heads 4 --num-query-groups 2 --ffn-hidden-size 32 --seq-length 16
--num-layers 2 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 24 --moe-router-dtype fp32``:

- ``mixtral``: ``--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2`` (softmax), MoE in
  both layers (``--moe-layer-freq 1``: the homogeneous, layer-stacked keys);
- ``shared``: ``--moe-layer-freq ([1]+[0])`` (layer 1 MoE, layer 2 dense: per-layer keys ``decoder.layers.<g>.``),
  ``--moe-shared-expert-intermediate-size 20``, ``--moe-router-score-function sigmoid
  --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2 --moe-router-load-balancing-type none``.

Each: Adam (not distributed) from ``get_megatron_optimizer``, 3 iterations on token batches from
``torch.Generator().manual_seed(1234)`` (``MoEAuxLossAutoScaler`` scale 1: one micro-batch; the expert bias is
updated after each step by megatron-core's ``_update_router_expert_bias``, as its finalize_model_grads does),
then ``<name>/torch`` (legacy, ``mp_rank_00/model_optim_rng.pt``), ``<name>/torch_dist`` (``dist_checkpointing.save``
of ``sharded_state_dict()`` with the content metadata Megatron-LM passes) and ``<name>/reference.pt`` (the
writer's logits, losses, parameter names in Megatron's order with parameter and Adam-moment norms, and the
``expert_bias`` buffers), in the same form as ``../reference.pt``.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import generate as base  # noqa: E402  (applies the CPU shims before megatron.core is imported)

import torch.distributed as dist  # noqa: E402

from megatron.core import dist_checkpointing, parallel_state  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.transformer.moe import moe_utils  # noqa: E402
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

# megatron-core 0.14.0 names te_general_gemm in router_gating_linear only when Transformer Engine imports;
# without it the name is undefined (NameError). None is what the check means: the plain matmul path.
if not hasattr(moe_utils, "te_general_gemm"):
    moe_utils.te_general_gemm = None

ITERATIONS, SEED = 3, 1234
NUM_LAYERS, HIDDEN, HEADS, GROUPS, FFN, SEQ = 2, 16, 4, 2, 32, 16
VOCAB_ARG, PADDED_VOCAB = 100, 128
EXPERTS, TOPK, MOE_FFN = 4, 2, 24
MICRO_BATCH = GLOBAL_BATCH = 4
LR, MIN_LR, WD, CLIP = 1e-3, 1e-4, 0.1, 0.0
TRAIN_ITERS, WARMUP_ITERS = 10, 1

VARIANTS = {
    "mixtral": dict(moe_layer_freq=1, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
                    moe_router_score_function="softmax", moe_shared_expert_intermediate_size=None,
                    moe_router_enable_expert_bias=False, moe_router_bias_update_rate=1e-3),
    "shared": dict(moe_layer_freq=[1, 0], moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
                   moe_router_score_function="sigmoid", moe_shared_expert_intermediate_size=20,
                   moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2),
}


def megatron_args(variant, ckpt_format, iteration):
    """The args Namespace Megatron-LM saves for this variant's command line (the module docstring)."""
    args = base.megatron_args(ckpt_format, iteration, iteration * GLOBAL_BATCH)
    moe = VARIANTS[variant]
    for name, value in dict(
            num_layers=NUM_LAYERS, encoder_num_layers=NUM_LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN,
            num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS, group_query_attention=True,
            num_query_groups=GROUPS, seq_length=SEQ, encoder_seq_length=SEQ, max_position_embeddings=SEQ,
            position_embedding_type="rope", add_position_embedding=False, padded_vocab_size=PADDED_VOCAB,
            vocab_size=VOCAB_ARG, normalization="RMSNorm", swiglu=True, untie_embeddings_and_output_weights=True,
            add_bias_linear=False, add_qkv_bias=False, bias_swiglu_fusion=False,
            num_experts=EXPERTS, moe_router_topk=TOPK, moe_ffn_hidden_size=MOE_FFN, moe_router_dtype="fp32",
            moe_token_dispatcher_type="allgather", moe_grouped_gemm=False, moe_z_loss_coeff=None,
            moe_expert_capacity_factor=None, moe_pad_expert_input_to_capacity=False,
            moe_token_drop_policy="probs", moe_router_pre_softmax=False, moe_router_topk_scaling_factor=None,
            moe_router_num_groups=None, moe_router_group_topk=None, moe_per_layer_logging=False,
            expert_tensor_parallel_size=1, moe_use_legacy_grouped_gemm=False,
            moe_router_load_balancing_type=[moe["moe_router_load_balancing_type"]],
            moe_aux_loss_coeff=[moe["moe_aux_loss_coeff"]],
            **{k: v for k, v in moe.items() if k not in ("moe_router_load_balancing_type", "moe_aux_loss_coeff")},
    ).items():
        setattr(args, name, value)
    return args


def build_model(variant):
    moe = VARIANTS[variant]
    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, ffn_hidden_size=FFN, num_attention_heads=HEADS,
        num_query_groups=GROUPS, attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.02,
        use_cpu_initialization=True, params_dtype=torch.float32, layernorm_epsilon=1e-5, add_bias_linear=False,
        add_qkv_bias=False, normalization="RMSNorm", gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        masked_softmax_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        gradient_accumulation_fusion=False, num_moe_experts=EXPERTS, moe_router_topk=TOPK,
        moe_ffn_hidden_size=MOE_FFN, moe_router_dtype="fp32", moe_token_dispatcher_type="allgather", **moe)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(config, spec, vocab_size=PADDED_VOCAB, max_sequence_length=SEQ, pre_process=True,
                     post_process=True, share_embeddings_and_output_weights=False, position_embedding_type="rope")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config, ddp_config, model), config


def build_optimizer(model):
    config = OptimizerConfig(optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WD, adam_beta1=0.9,
                             adam_beta2=0.999, adam_eps=1e-8, clip_grad=CLIP, fp16=False, bf16=False,
                             params_dtype=torch.float32, use_distributed_optimizer=False)
    optimizer = get_megatron_optimizer(config, [model])
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP_ITERS * GLOBAL_BATCH,
        lr_decay_steps=TRAIN_ITERS * GLOBAL_BATCH, lr_decay_style="cosine", start_wd=WD, end_wd=WD,
        wd_incr_steps=TRAIN_ITERS * GLOBAL_BATCH, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=False, override_opt_param_scheduler=False)
    return optimizer, scheduler


def batch(generator):
    """A [MICRO_BATCH, SEQ] batch: tokens, labels, causal mask (True = masked), positions."""
    data = torch.randint(0, VOCAB_ARG + 1, (MICRO_BATCH, SEQ + 1), generator=generator)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    mask = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ) < 0.5
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ).contiguous()
    return tokens, labels, mask, positions


def train(model, config, optimizer, scheduler):
    generator = torch.Generator().manual_seed(SEED)
    MoEAuxLossAutoScaler.set_loss_scale(torch.ones(1))  # one micro-batch per step
    losses = []
    for _ in range(ITERATIONS):
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, labels, mask, positions = batch(generator)
        loss = model(tokens, positions, mask, labels=labels).float().mean()
        loss.backward()
        model.finish_grad_sync()
        if config.moe_router_enable_expert_bias:
            _update_router_expert_bias([model], config)
        success, _, _ = optimizer.step()
        assert success
        scheduler.step(increment=GLOBAL_BATCH)
        losses.append(loss.item())
    return losses


def save_legacy(out_dir, variant, model, optimizer, scheduler):
    save_dir = os.path.join(out_dir, "torch")
    name = os.path.join(save_dir, f"iter_{ITERATIONS:07d}", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(name), exist_ok=True)
    torch.save({"args": megatron_args(variant, "torch", ITERATIONS), "checkpoint_version": 3.0,
                "iteration": ITERATIONS, "model": model.module.state_dict_for_save_checkpoint(),
                "optimizer": optimizer.state_dict(), "opt_param_scheduler": scheduler.state_dict(),
                "rng_state": base.rng_state(), "num_floating_point_operations_so_far": 0}, name)
    base.write_tracker(save_dir, ITERATIONS)


def save_torch_dist(out_dir, variant, model, optimizer, scheduler):
    save_dir = os.path.join(out_dir, "torch_dist")
    ckpt_dir = os.path.join(save_dir, f"iter_{ITERATIONS:07d}")
    os.makedirs(ckpt_dir, exist_ok=True)
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    state_dict = {"args": megatron_args(variant, "torch_dist", ITERATIONS), "checkpoint_version": 3.0,
                  "iteration": ITERATIONS,
                  "model": model.module.sharded_state_dict(metadata={**metadata, "dp_cp_group": dp_group})}
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata={**metadata, "dp_cp_group": dp_group})
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    state_dict["rng_state"] = ShardedObject("rng_state", base.rng_state(), (1, 1), (0, 0), replica_id=0)
    state_dict["num_floating_point_operations_so_far"] = 0
    dist_checkpointing.save(state_dict, ckpt_dir, content_metadata=metadata)
    base.write_tracker(save_dir, ITERATIONS)


def reference(model, optimizer, losses):
    generator = torch.Generator().manual_seed(SEED + 1)
    tokens, _, mask, positions = batch(generator)
    tokens, positions = tokens[:2], positions[:2]
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions, mask)  # [b, s, padded vocab]
    inner = optimizer.optimizer
    by_param = {param: name for name, param in model.module.named_parameters()}
    names, param_norm, exp_avg, exp_avg_sq = [], [], [], []
    for name, param in model.module.named_parameters():
        names.append(name)
        param_norm.append(param.detach().double().norm().item())
        exp_avg.append(inner.state[param]["exp_avg"].double().norm().item())
        exp_avg_sq.append(inner.state[param]["exp_avg_sq"].double().norm().item())
    groups = [{"wd_mult": g["wd_mult"], "lr_mult": g["lr_mult"], "is_expert_parallel": g["is_expert_parallel"],
               "names": [by_param[p] for p in g["params"]]} for g in inner.param_groups]
    buffers = {name: value.detach().clone() for name, value in model.module.named_buffers()
               if name.endswith("expert_bias")}
    return {"input_ids": tokens, "position_ids": positions, "logits": logits.detach().clone(),
            "losses": torch.tensor(losses, dtype=torch.float64), "param_names": names,
            "param_norm": torch.tensor(param_norm, dtype=torch.float64),
            "exp_avg_norm": torch.tensor(exp_avg, dtype=torch.float64),
            "exp_avg_sq_norm": torch.tensor(exp_avg_sq, dtype=torch.float64), "param_groups": groups,
            "expert_bias": buffers, "megatron_core_version": __import__("megatron.core").core.__version__}


def main():
    out_root = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    base.init_distributed()
    for variant in VARIANTS:
        out_dir = os.path.join(out_root, variant)
        base.set_seed(SEED)
        model, config = build_model(variant)
        optimizer, scheduler = build_optimizer(model)
        losses = train(model, config, optimizer, scheduler)
        save_legacy(out_dir, variant, model, optimizer, scheduler)
        save_torch_dist(out_dir, variant, model, optimizer, scheduler)
        torch.save(reference(model, optimizer, losses), os.path.join(out_dir, "reference.pt"))
        print(f"{variant}: losses {losses}; wrote {out_dir}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
