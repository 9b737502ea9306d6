"""Load a checkpoint through Megatron-LM core_v0.14.0's own ``load_checkpoint`` and dump what it loaded.

Run it with the unpacked megatron-core 0.14.0 wheel and a Megatron-LM checkout at tag core_v0.14.0 on
the path, never with this project's ``megatron`` package (all three are named ``megatron``; the wheel
and the checkout are namespace packages and combine)::

    PYTHONPATH=$MCORE_V014_PATH:$MEGATRON_LM_V014_PATH python tests/mcore_reference/megatron_load_checkpoint.py \
        OUT.pt REFERENCE.pt -- <Megatron-LM pretrain_gpt.py flags, --load DIR among them>

What runs is Megatron-LM's code path for ``pretrain_gpt.py --load``: its ``parse_args`` /
``validate_args`` / ``set_global_variables`` on the given flags, its ``pretrain_gpt.model_provider``
(``--transformer-impl local``: the local spec), megatron.core's DistributedDataParallel with the
config ``get_model`` builds, ``get_megatron_optimizer`` (its DistributedOptimizer with
``--use-distributed-optimizer``), ``get_optimizer_param_scheduler`` and finally
``megatron.training.checkpointing.load_checkpoint``: it reads ``common.pt`` and its
``content_metadata``, builds the sharded state dict for that metadata, loads it with
``dist_checkpointing.load`` and puts it into model, optimizer, scheduler and RNGs.
One process, a one-rank gloo group, CPU. Replaced (below): CPU stand-ins for the CUDA calls Megatron
makes outside its kernels (``torch.cuda.get_rng_state`` gives a template, ``torch.cuda.set_rng_state``
accepts only what a CUDA generator accepts, a uint8 tensor of 16 bytes, and records it), the RNG
tracker's fork (dropout is 0), and ``DistributedOptimizer._set_main_param_and_optimizer_states``, which
in 0.14 without Apex/Transformer Engine fails on every checkpoint (it copies Adam's ``step`` too).

OUT.pt receives (tensors, strings and numbers only): ``iteration``, ``names`` (Megatron's
``named_parameters()`` order), ``weights`` / ``exp_avg`` / ``exp_avg_sq`` (lists in that order,
parameter-shaped; the distributed optimizer's flat shards put back in shape), ``steps`` (Adam's step
per param group), ``scheduler_num_steps``, ``consumed_train_samples``, ``logits`` for REFERENCE.pt's
``input_ids`` / ``position_ids`` (causal mask), ``content_metadata`` (the dict Megatron read, or None),
``cuda_rng_state`` (the state Megatron handed to ``torch.cuda.set_rng_state``, or absent) and
``rng_tracker_states`` (name -> state Megatron's RNG tracker holds after the load).
"""
import importlib.util
import os
import sys

import torch

import cpu_stand_ins  # beside this file: the script directory is on sys.path

# ---- CPU stand-ins (cpu_stand_ins), and CUDA RNG state calls that record what Megatron loads ------
_CUDA_STATE_BYTES = 16  # torch's CUDA (Philox) generator state: uint64 seed + int64 offset
_SET_CUDA_STATES = []

cpu_stand_ins.install()
if not torch.cuda.is_available():
    def _check_cuda_state(state):
        # What CUDAGeneratorImpl::set_state accepts: a CPU uint8 tensor of 16 bytes (seed, offset).
        if not isinstance(state, torch.Tensor) or state.dtype != torch.uint8 or state.numel() != _CUDA_STATE_BYTES:
            raise RuntimeError(f"not a CUDA generator state: {type(state).__name__} "
                               f"{getattr(state, 'dtype', '')} {tuple(getattr(state, 'shape', ()))}")

    def _get_cuda_rng_state(device="cuda"):
        # The template Megatron's get_rng_state builds before the load (replaced by the checkpoint's).
        return torch.zeros(_CUDA_STATE_BYTES, dtype=torch.uint8)

    def _set_cuda_rng_state(new_state, device="cuda"):
        _check_cuda_state(new_state)
        _SET_CUDA_STATES.append(new_state.clone())

    torch.cuda.get_rng_state = _get_cuda_rng_state
    torch.cuda.set_rng_state = _set_cuda_rng_state


def _megatron_lm_root():
    for entry in sys.path:
        if os.path.isfile(os.path.join(entry, "pretrain_gpt.py")) and os.path.isdir(
                os.path.join(entry, "megatron", "training")):
            return entry
    raise SystemExit("no Megatron-LM checkout (pretrain_gpt.py, megatron/training) on PYTHONPATH")


def main():
    if "--" not in sys.argv or len(sys.argv[:sys.argv.index("--")]) != 3:
        raise SystemExit(__doc__.split("\n\n")[1])
    split = sys.argv.index("--")
    out_path, reference_path = sys.argv[1:split]
    flags = sys.argv[split + 1:]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")

    import torch.distributed as dist

    from megatron.core import mpu, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training import checkpointing
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import get_args, set_global_variables
    from megatron.training.training import get_optimizer_param_scheduler

    cpu_stand_ins.patch_megatron()

    spec = importlib.util.spec_from_file_location("megatron_lm_pretrain_gpt",
                                                  os.path.join(_megatron_lm_root(), "pretrain_gpt.py"))
    pretrain_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pretrain_gpt)

    sys.argv = ["pretrain_gpt.py", *flags]
    args = parse_args()
    validate_args(args, {})
    set_global_variables(args, build_tokenizer=True)
    args = get_args()
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")
    mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipeline_model_parallel_size)

    # get_model (megatron/training/training.py) without its .cuda(): build, default TP attributes, DDP.
    torch.manual_seed(7)  # other initial values than the checkpoint's
    model = pretrain_gpt.model_provider(pre_process=True, post_process=True)
    for param in model.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
    import dataclasses

    kwargs = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistributedDataParallelConfig)
              if hasattr(args, f.name)}
    kwargs.update(grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
                  check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad,
                  check_for_large_grads=args.check_for_large_grads, bucket_size=args.ddp_bucket_size,
                  pad_buckets_for_high_nccl_busbw=args.ddp_pad_buckets_for_high_nccl_busbw,
                  average_in_collective=args.ddp_average_in_collective)
    ddp_config = DistributedDataParallelConfig(**kwargs)
    if not ddp_config.overlap_grad_reduce:
        ddp_config.bucket_size = None
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)

    # setup_model_and_optimizer: OptimizerConfig from the args, get_megatron_optimizer, the scheduler.
    optimizer_config = OptimizerConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(OptimizerConfig)
                                          if hasattr(args, f.name)})
    optimizer = get_megatron_optimizer(optimizer_config, [ddp])
    scheduler = get_optimizer_param_scheduler(optimizer)
    subs = getattr(optimizer, "chained_optimizers", [optimizer])
    if args.use_distributed_optimizer:
        # Without Apex/TE, DistributedOptimizer.state_dict() reads Adam's step from existing state (after
        # a first step); give the fresh state a placeholder step: the checkpoint's values replace it.
        for sub in subs:
            sub.init_state_fn(sub.optimizer, sub.config)
            for state in sub.optimizer.state.values():
                state.setdefault("step", torch.tensor(0.0))

    content_metadata = []
    original = checkpointing.dist_checkpointing.load_content_metadata

    def _recorded(*a, **k):
        value = original(*a, **k)
        content_metadata.append(value)
        return value

    checkpointing.dist_checkpointing.load_content_metadata = _recorded
    iteration, _ = checkpointing.load_checkpoint([ddp], optimizer, scheduler, strict=True)

    reference = torch.load(reference_path, weights_only=True)
    seq = reference["input_ids"].shape[1]
    mask = torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq) < 0.5
    model.eval()
    with torch.no_grad():
        logits = model(reference["input_ids"], reference["position_ids"], mask)
    names, weights, exp_avg, exp_avg_sq = [], [], [], []
    for name, param in model.named_parameters():
        sub = subs[0]
        if args.use_distributed_optimizer:
            state = sub._get_main_param_and_optimizer_states(param)  # one rank: the whole flat param
        else:
            state = sub.optimizer.state[param]
        names.append(name)
        weights.append(param.detach().clone())
        exp_avg.append(state["exp_avg"].detach().view(param.shape).clone())
        exp_avg_sq.append(state["exp_avg_sq"].detach().view(param.shape).clone())
    steps = [float(group["step"]) if "step" in group else
             max(float(sub.optimizer.state[p]["step"]) for p in group["params"])
             for sub in subs for group in sub.optimizer.param_groups]
    tracker = tensor_parallel.get_cuda_rng_tracker().get_states()
    out = {"iteration": iteration, "names": names, "weights": weights, "exp_avg": exp_avg,
           "exp_avg_sq": exp_avg_sq, "steps": steps, "scheduler_num_steps": scheduler.num_steps,
           "consumed_train_samples": args.consumed_train_samples, "logits": logits,
           "content_metadata": content_metadata[-1] if content_metadata else None,
           "rng_tracker_states": {k: v.clone() for k, v in tracker.items()}}
    if _SET_CUDA_STATES:
        out["cuda_rng_state"] = _SET_CUDA_STATES[-1]
    torch.save(out, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
