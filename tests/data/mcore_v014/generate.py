"""Write the Megatron-LM core_v0.14.0 checkpoints under tests/data/mcore_v014/ with the real megatron-core.

Run it with the unpacked megatron-core==0.14.0 wheel first on the path (never with this project's
``megatron`` package, which has the same name)::

    PYTHONPATH=/path/to/unpacked/megatron_core-0.14.0 python tests/data/mcore_v014/generate.py [OUT_DIR]

(``/work/mcore_site`` is such a directory on the development machine; ``pip download
megatron-core==0.14.0 --no-deps`` and unzipping the wheel makes one.) OUT_DIR defaults to this
file's directory. It runs on the CPU in one process with a one-rank gloo group, in a few seconds;
megatron-core's torch_dist writer also needs ``psutil`` importable.

What it does, mirroring what Megatron-LM's ``pretrain_gpt.py`` (core_v0.14.0) would do for::

    --num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32
    --max-position-embeddings 32 --tokenizer-type NullTokenizer --vocab-size 1000
    --attention-dropout 0 --hidden-dropout 0 --transformer-impl local
    --micro-batch-size 4 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine
    --lr-warmup-iters 1 --train-iters 10 --weight-decay 0.1 --clip-grad 0 --seed 1234

1. builds GPTModel with get_gpt_layer_local_spec (LayerNorm, biases, GELU, learned absolute
   positions, tied embedding/output weights, vocabulary 1001 padded to 1024), wrapped in
   megatron.core's DistributedDataParallel (as Megatron-LM's get_model does);
2. builds the optimizer with megatron.core.optimizer.get_megatron_optimizer (Adam, fp32, not
   distributed) and OptimizerParamScheduler;
3. trains 3 iterations on deterministic token batches (torch.Generator seeded 1234);
4. writes, following megatron/training/checkpointing.py of Megatron-LM:
   - ``torch/``: legacy format, ``iter_0000003/mp_rank_00/model_optim_rng.pt`` holding
     generate_state_dict's keys for --ckpt-format torch (args, checkpoint_version 3.0, iteration,
     model = state_dict_for_save_checkpoint(), optimizer = optimizer.state_dict(),
     opt_param_scheduler, rng_state, num_floating_point_operations_so_far) + the tracker file;
   - ``torch_dist/``: ``iter_0000003/`` written by megatron.core.dist_checkpointing.save from
     model.sharded_state_dict() + optimizer.sharded_state_dict(...) + the same common entries,
     rng_state as a ShardedObject, content metadata as Megatron-LM passes it + the tracker file;
   - ``reference.pt`` (tensors, strings and numbers only): the writer's logits on a fixed batch
     (``input_ids``, ``position_ids`` [2, 32], ``logits`` [2, 32, 1024], causal mask), the training losses, the
     parameter names in Megatron's order (``param_names``) with, per name, the norms of the
     parameter and of its Adam ``exp_avg`` and ``exp_avg_sq`` (``param_norm``, ``exp_avg_norm``,
     ``exp_avg_sq_norm``, float64 tensors in ``param_names`` order) and the optimizer's param
     groups as (wd_mult, lr_mult, names) (``param_groups``).

The saved ``args`` is an argparse.Namespace built here with Megatron-LM's argument names and the
values its parse_args/validate_args give for the command line above (megatron/training is not in
the megatron-core wheel); like Megatron's, it holds ``attention_backend=AttnBackend.auto``,
``model_type=ModelType.encoder_or_decoder`` and ``params_dtype=torch.float32``.
"""
import argparse
import contextlib
import os
import random
import sys

import numpy as np
import torch

# CPU shims: megatron-core 0.14 allocates its grad buffers on torch.cuda.current_device(), a few
# scalars on 'cuda', and forks the CUDA RNG tracker around attention dropout; on a machine without
# CUDA the first two go to the CPU and the fork does nothing (dropout is 0 here: nothing is drawn);
# the torch_dist writer's torch.cuda.synchronize() has nothing to wait for.
CPU_ONLY = not torch.cuda.is_available()
if CPU_ONLY:
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.current_device = lambda: "cpu"
    _tensor = torch.tensor

    def _cpu_tensor(*args, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = "cpu"
        return _tensor(*args, device=device, **kwargs)

    torch.tensor = _cpu_tensor

import torch.distributed as dist  # noqa: E402

from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core import dist_checkpointing  # noqa: E402
from megatron.core.dist_checkpointing.mapping import ShardedObject  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.transformer.enums import AttnBackend  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

if CPU_ONLY:
    tensor_parallel.random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()

ITERATIONS = 3
SEED = 1234
NUM_LAYERS, HIDDEN, HEADS, SEQ = 2, 32, 4, 32
VOCAB_ARG = 1000  # --vocab-size; the NullTokenizer adds an EOD token
VOCAB = VOCAB_ARG + 1
PADDED_VOCAB = 1024  # rounded up to --make-vocab-size-divisible-by 128
MICRO_BATCH = GLOBAL_BATCH = 4
LR, MIN_LR, WD, CLIP = 1e-3, 1e-4, 0.1, 0.0  # clip_grad_by_total_norm_fp32 asserts CUDA grads
TRAIN_ITERS, WARMUP_ITERS = 10, 1


def megatron_args(ckpt_format, iteration, consumed_train_samples):
    """The args Namespace Megatron-LM saves for the command line in this module's docstring."""
    ffn = 4 * HIDDEN
    return argparse.Namespace(
        # model
        num_layers=NUM_LAYERS, encoder_num_layers=NUM_LAYERS, decoder_num_layers=None,
        hidden_size=HIDDEN, ffn_hidden_size=ffn, num_attention_heads=HEADS, kv_channels=HIDDEN // HEADS,
        group_query_attention=False, num_query_groups=HEADS, seq_length=SEQ, encoder_seq_length=SEQ,
        decoder_seq_length=None, max_position_embeddings=SEQ, position_embedding_type="learned_absolute",
        rotary_percent=1.0, rotary_base=10000, add_position_embedding=True,
        make_vocab_size_divisible_by=128, padded_vocab_size=PADDED_VOCAB, vocab_size=VOCAB_ARG,
        normalization="LayerNorm", norm_epsilon=1e-5, apply_layernorm_1p=False,
        apply_residual_connection_post_layernorm=False, openai_gelu=False, squared_relu=False, swiglu=False,
        untie_embeddings_and_output_weights=False, add_bias_linear=True, add_qkv_bias=True,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.02, qk_layernorm=False,
        transformer_impl="local", attention_backend=AttnBackend.auto, model_type=ModelType.encoder_or_decoder,
        num_experts=None, spec=None, attention_softmax_in_fp32=False, apply_query_key_layer_scaling=False,
        masked_softmax_fusion=True, bias_gelu_fusion=False, bias_dropout_fusion=True,
        cross_entropy_loss_fusion=False, gradient_accumulation_fusion=False,
        # precision
        fp16=False, bf16=False, params_dtype=torch.float32, loss_scale=None, initial_loss_scale=4294967296,
        fp8=None, accumulate_allreduce_grads_in_fp32=False,
        # parallelism
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1, context_parallel_size=1,
        expert_model_parallel_size=1, virtual_pipeline_model_parallel_size=None, sequence_parallel=False,
        data_parallel_size=1, world_size=1, rank=0, local_rank=0, distributed_backend="gloo",
        use_distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False,
        data_parallel_random_init=False,
        # optimizer and schedule
        optimizer="adam", lr=LR, min_lr=MIN_LR, lr_decay_style="cosine", lr_decay_iters=None,
        lr_decay_samples=None, lr_warmup_iters=WARMUP_ITERS, lr_warmup_samples=0, lr_warmup_init=0.0,
        lr_warmup_fraction=None, weight_decay=WD, start_weight_decay=WD, end_weight_decay=WD,
        weight_decay_incr_style="constant", clip_grad=CLIP, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        sgd_momentum=0.9, micro_batch_size=MICRO_BATCH, global_batch_size=GLOBAL_BATCH,
        rampup_batch_size=None, train_iters=TRAIN_ITERS, train_samples=None,
        override_opt_param_scheduler=False, use_checkpoint_opt_param_scheduler=False,
        decoupled_lr=None, decoupled_min_lr=None,
        # data and tokenizer
        tokenizer_type="NullTokenizer", vocab_file=None, merge_file=None, tokenizer_model=None,
        mock_data=True, data_path=None, split="969, 30, 1", num_workers=2, reset_position_ids=False,
        reset_attention_mask=False, eod_mask_loss=False, create_attention_mask_in_dataloader=True,
        # checkpointing
        save=None, load=None, save_interval=ITERATIONS, ckpt_format=ckpt_format,
        use_dist_ckpt=ckpt_format != "torch", auto_detect_ckpt_format=False, no_save_optim=None,
        no_save_rng=None, no_load_optim=None, no_load_rng=None, finetune=False,
        exit_on_missing_checkpoint=False, async_save=None, ckpt_fully_parallel_save=True,
        dist_ckpt_strictness="assume_ok_unexpected",
        # run
        seed=SEED, iteration=iteration, eval_iters=0, eval_interval=1000, log_interval=1,
        rerun_mode="disabled", consumed_train_samples=consumed_train_samples, skipped_train_samples=0,
        consumed_valid_samples=0,
    )


def init_distributed():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def set_seed(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model():
    config = TransformerConfig(
        num_layers=NUM_LAYERS, hidden_size=HIDDEN, ffn_hidden_size=4 * HIDDEN, num_attention_heads=HEADS,
        attention_dropout=0.0, hidden_dropout=0.0, init_method_std=0.02, use_cpu_initialization=True,
        params_dtype=torch.float32, layernorm_epsilon=1e-5, add_bias_linear=True, add_qkv_bias=True,
        normalization="LayerNorm", masked_softmax_fusion=False, bias_activation_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=PADDED_VOCAB, max_sequence_length=SEQ,
                     pre_process=True, post_process=True, share_embeddings_and_output_weights=True,
                     position_embedding_type="learned_absolute")
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=False, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    return DistributedDataParallel(config, ddp_config, model)


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


def ltor_batch(generator):
    """A [MICRO_BATCH, SEQ] batch of tokens, labels, causal mask (True = masked) and positions."""
    data = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
    tokens, labels = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    mask = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ) < 0.5
    positions = torch.arange(SEQ).unsqueeze(0).expand(MICRO_BATCH, SEQ).contiguous()
    return tokens, labels, mask, positions


def train(model, optimizer, scheduler):
    generator = torch.Generator().manual_seed(SEED)
    losses = []
    for _ in range(ITERATIONS):
        model.train()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        tokens, labels, mask, positions = ltor_batch(generator)
        per_token = model(tokens, positions, mask, labels=labels)  # [b, s]
        loss = per_token.float().mean()
        loss.backward()
        model.finish_grad_sync()
        success, _, _ = optimizer.step()
        assert success
        scheduler.step(increment=GLOBAL_BATCH)
        losses.append(loss.item())
    return losses


def rng_state():
    """Megatron-LM's get_rng_state entry for one data-parallel rank (a list of one dict)."""
    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(),
             "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.ByteTensor(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return [state]


def write_tracker(save_dir, iteration):
    with open(os.path.join(save_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def save_legacy(out_dir, model, optimizer, scheduler, flops):
    save_dir = os.path.join(out_dir, "torch")
    name = os.path.join(save_dir, f"iter_{ITERATIONS:07d}", "mp_rank_00", "model_optim_rng.pt")
    os.makedirs(os.path.dirname(name), exist_ok=True)
    state_dict = {
        "args": megatron_args("torch", ITERATIONS, ITERATIONS * GLOBAL_BATCH),
        "checkpoint_version": 3.0,
        "iteration": ITERATIONS,
        "model": model.module.state_dict_for_save_checkpoint(),
        "optimizer": optimizer.state_dict(),
        "opt_param_scheduler": scheduler.state_dict(),
        "rng_state": rng_state(),
        "num_floating_point_operations_so_far": flops,
    }
    torch.save(state_dict, name)
    write_tracker(save_dir, ITERATIONS)


def save_torch_dist(out_dir, model, optimizer, scheduler, flops):
    save_dir = os.path.join(out_dir, "torch_dist")
    ckpt_dir = os.path.join(save_dir, f"iter_{ITERATIONS:07d}")
    os.makedirs(ckpt_dir, exist_ok=True)
    # Megatron-LM's _build_sharded_state_dict_metadata for a run without the distributed optimizer.
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    model_sd = model.module.sharded_state_dict(metadata={**metadata, "dp_cp_group": dp_group})
    state_dict = {
        "args": megatron_args("torch_dist", ITERATIONS, ITERATIONS * GLOBAL_BATCH),
        "checkpoint_version": 3.0,
        "iteration": ITERATIONS,
        "model": model_sd,
    }
    state_dict["optimizer"] = optimizer.sharded_state_dict(state_dict, metadata={**metadata,
                                                                               "dp_cp_group": dp_group})
    state_dict["opt_param_scheduler"] = scheduler.state_dict()
    state_dict["rng_state"] = ShardedObject("rng_state", rng_state(), (1, 1), (0, 0), replica_id=0)
    state_dict["num_floating_point_operations_so_far"] = flops
    dist_checkpointing.save(state_dict, ckpt_dir, content_metadata=metadata)
    write_tracker(save_dir, ITERATIONS)


def reference(model, optimizer, losses):
    generator = torch.Generator().manual_seed(SEED + 1)
    tokens, _, mask, positions = ltor_batch(generator)
    tokens, positions = tokens[:2], positions[:2]  # two sequences keep the logits file small
    model.eval()
    with torch.no_grad():
        logits = model(tokens, positions, mask)  # [b, s, padded vocab]
    names = [name for name, _ in model.module.named_parameters()]
    by_param = {param: name for name, param in model.module.named_parameters()}
    inner = optimizer.optimizer  # torch's Adam(W) under Megatron's FP32Optimizer
    exp_avg, exp_avg_sq, param_norm = [], [], []
    for name, param in model.module.named_parameters():
        state = inner.state[param]
        param_norm.append(param.detach().double().norm().item())
        exp_avg.append(state["exp_avg"].double().norm().item())
        exp_avg_sq.append(state["exp_avg_sq"].double().norm().item())
    groups = [{"wd_mult": g["wd_mult"], "lr_mult": g["lr_mult"], "names": [by_param[p] for p in g["params"]]}
              for g in inner.param_groups]
    return {"input_ids": tokens, "position_ids": positions, "logits": logits.detach().clone(),
            "losses": torch.tensor(losses, dtype=torch.float64), "param_names": names,
            "param_norm": torch.tensor(param_norm, dtype=torch.float64),
            "exp_avg_norm": torch.tensor(exp_avg, dtype=torch.float64),
            "exp_avg_sq_norm": torch.tensor(exp_avg_sq, dtype=torch.float64), "param_groups": groups,
            "megatron_core_version": __import__("megatron.core").core.__version__}


def main():
    out_dir = sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__))
    init_distributed()
    set_seed(SEED)
    model = build_model()
    optimizer, scheduler = build_optimizer(model)
    losses = train(model, optimizer, scheduler)
    flops = 0  # the GPT formula is in megatron/training, not in the wheel; recorded as 0
    save_legacy(out_dir, model, optimizer, scheduler, flops)
    save_torch_dist(out_dir, model, optimizer, scheduler, flops)
    torch.save(reference(model, optimizer, losses), os.path.join(out_dir, "reference.pt"))
    print(f"losses {losses}; wrote {out_dir}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
