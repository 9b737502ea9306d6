"""The ``torch_dist`` checkpoint format over core.dist_checkpointing: sharded, reshardable, Megatron-LM core_v0.14's layout."""
import os

from megatron.core.dist_checkpointing import model_and_optimizer as mo
from megatron.core.dist_checkpointing import serialization
from megatron.core.dist_checkpointing.safe_loading import CheckpointReadError, load_torch_file
from megatron.training.checkpointing.async_save import start_torch_dist_save
from megatron.training.checkpointing.collectives import world_rank
from megatron.training.checkpointing.errors import CheckpointContentError
from megatron.training.checkpointing.layout import (
    RNG_DIRNAME,
    common_file_name,
    common_state,
    current_parallel_layout,
    read_common_state,
    rng_file_name,
)
from megatron.training.checkpointing.state import (
    check_checkpoint_args,
    sanitized_args,
    saved_args,
    set_checkpoint_version,
    set_rng_state,
    warn_if_vocab_padding_differs,
)
from megatron.training.config.training_config import CheckpointConfig
from megatron.training.utils import print_rank_0


def save_torch_dist(args, cfg: CheckpointConfig, tmp_dir, model, optimizer, opt_param_scheduler, rng_state, state,
                    distributed_optimizer=False, worker_attributes=None):
    """Write a torch_dist checkpoint of ``state.iteration`` into ``tmp_dir``; all ranks call it. Returns None once
    written, or the started async_save.AsyncTorchDistWriter with ``--async-save``. ``args`` is only stored
    (sanitized) in ``common.pt``; ``distributed_optimizer``: --use-distributed-optimizer."""
    common = torch_dist_common_state(args, cfg, optimizer, opt_param_scheduler, state, distributed_optimizer)
    return start_torch_dist_save(cfg, tmp_dir, model, optimizer, common, rng_state, worker_attributes)


def torch_dist_common_state(args, cfg: CheckpointConfig, optimizer, opt_param_scheduler, state,
                            distributed_optimizer=False):
    """``common.pt`` of a torch_dist checkpoint (written by rank 0; the same on every rank); ``args`` is stored
    sanitized."""
    saved_args = sanitized_args(args)
    for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
        setattr(saved_args, name, getattr(state, name))  # where Megatron-LM readers look for them
    save_optim = cfg.save_optim
    return common_state(
        saved_args, state.iteration, state.state_dict(), state.num_floating_point_operations_so_far,
        current_parallel_layout(), distributed_optimizer,
        mo.optimizer_common_state(optimizer) if save_optim and optimizer is not None else None,
        opt_param_scheduler.state_dict() if save_optim and opt_param_scheduler is not None else None)


def load_torch_dist(cfg: CheckpointConfig, iteration_dir, iteration, release, context, model, optimizer, opt_param_scheduler,
                    strict, restored):
    """Load a torch_dist checkpoint, resharding to this run's layout; returns the iteration. All ranks call it.

    ``common.pt`` gives the counters, scheduler and optimizer hyper-parameters; DCP reads this
    rank's chunks of every model (and optimizer) tensor in place; RNG states are restored only when
    the parallel layout is the one saved (another layout has other RNG streams: a warning says so).
    An fp32 main copy missing from the checkpoint (saved in fp32) is rebuilt from the loaded weights.
    """
    common_name = common_file_name(iteration_dir)
    common = read_common_state(iteration_dir, context)
    checkpoint_args = saved_args(common, common_name, context)
    set_checkpoint_version(common.get("checkpoint_version", 0))
    warn_if_vocab_padding_differs(checkpoint_args, iteration_dir)
    if cfg.finetune or release:
        iteration = 0
    else:
        if "iteration" not in common:
            raise CheckpointReadError(f"checkpoint {common_name} ({context}) has no 'iteration' entry; load it with "
                                      "--finetune to start from iteration 0")
        iteration = common["iteration"]
        if checkpoint_args is not None:
            check_checkpoint_args(checkpoint_args, vocab_padding=False)
        if "train_state" in common:
            restored.load_state_dict(common["train_state"])
        else:  # written by Megatron-LM: the sample counters are in the saved args
            for name in ("consumed_train_samples", "skipped_train_samples", "consumed_valid_samples"):
                setattr(restored, name, getattr(checkpoint_args, name, 0) or 0)
            restored.num_floating_point_operations_so_far = common.get("num_floating_point_operations_so_far", 0)
    restored.iteration = iteration
    if cfg.finetune:
        restored.num_floating_point_operations_so_far = 0

    load_optim = optimizer is not None and not release and not cfg.finetune and cfg.load_optim
    if load_optim and "optimizer" not in common:
        raise CheckpointContentError(f"unable to load optimizer state from checkpoint {iteration_dir} (saved with "
                                     "--no-save-optim); specify --no-load-optim or --finetune to skip it")
    metadata = serialization.read_metadata(iteration_dir)
    # A model whose layers differ (MoE every few layers) has per-layer keys in Megatron's layout too.
    legacy = not mo.model_uses_per_layer_keys(model) and mo.is_per_layer_layout(metadata.state_dict_metadata)
    if legacy:
        print_rank_0(f"NOTE: checkpoint {iteration_dir} has this project's earlier per-layer torch_dist layout; it "
                     "loads, and checkpoints saved from now on have Megatron-LM's layer-stacked layout")
    sharded = mo.model_sharded_state(model, legacy=legacy)
    finishers = []
    if load_optim:
        mo.ensure_optimizer_state(optimizer)
        reads, finishers = mo.optimizer_load_plan(model, optimizer, metadata.state_dict_metadata, legacy)
        sharded += reads

    def is_main_param(key):
        return key.startswith(mo.OPTIMIZER_PREFIX + mo.MAIN_PARAM + ".") or key.endswith("." + mo.MAIN_PARAM)

    def allow_missing(key):
        # fp32 main copies exist only in checkpoints of fp16/bf16 runs (or with the distributed
        # optimizer); strict=False tolerates model keys.
        return is_main_param(key) or (not strict and not key.startswith(mo.OPTIMIZER_PREFIX))

    # An fp32 run reads its main params from the model weights, so the checkpoint's copies of them are
    # left unread on purpose: not "missing" for --dist-ckpt-strictness *_all.
    skipped = serialization.load(sharded, iteration_dir, metadata=metadata, allow_missing=allow_missing,
                                 strict=cfg.dist_ckpt_strictness, unread_ok=is_main_param)
    for finish in finishers:
        finish()
    main_param_skipped = any(key.startswith(mo.OPTIMIZER_PREFIX + mo.MAIN_PARAM + ".") or key.endswith(
        "." + mo.MAIN_PARAM) for key in skipped)
    if optimizer is not None and hasattr(optimizer, "reload_model_params") and (not load_optim or main_param_skipped):
        # fp32 main params not in the checkpoint start from the loaded (low-precision) weights.
        optimizer.reload_model_params()
    if load_optim:
        mo.load_optimizer_common_state(optimizer, common["optimizer"], iteration_dir)
        if opt_param_scheduler is not None:
            if "opt_param_scheduler" not in common:
                raise CheckpointContentError(f"unable to load the scheduler state from checkpoint {iteration_dir}; specify "
                                             "--no-load-optim or --finetune to skip it")
            opt_param_scheduler.load_state_dict(common["opt_param_scheduler"])

    if not release and not cfg.finetune and cfg.load_rng:
        _load_torch_dist_rng(iteration_dir, common, context)
    return iteration


def _load_torch_dist_rng(iteration_dir, common, context):
    if "parallel_layout" not in common and not os.path.isdir(os.path.join(iteration_dir, RNG_DIRNAME)):
        print_rank_0(f"WARNING: checkpoint {iteration_dir} was written by Megatron-LM (its RNG states are pickled "
                     "objects, which this loader does not unpickle): the RNG states are not restored")
        return
    saved_layout, layout = common.get("parallel_layout"), current_parallel_layout()
    if saved_layout != layout:
        print_rank_0(f"WARNING: checkpoint {iteration_dir} was saved with the parallel layout {saved_layout}, this run "
                     f"uses {layout}: the RNG states are not restored (each layout has its own RNG streams)")
        return
    name = rng_file_name(iteration_dir, world_rank())
    if not os.path.isfile(name):
        raise CheckpointContentError(f"unable to load rng state from checkpoint {iteration_dir}: {name} does not exist "
                                     "(saved with --no-save-rng?); specify --no-load-rng or --finetune to skip it")
    set_rng_state(load_torch_file(name, context)["rng_state"][0], name)
