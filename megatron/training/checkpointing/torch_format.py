"""Megatron-LM's legacy ``torch`` checkpoint format: one ``model_optim_rng.pt`` per (tp, pp[, ep]) rank, saved and loaded at the same layout."""
import os

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.safe_loading import load_torch_file
from megatron.training.checkpointing import legacy_optimizer_state
from megatron.training.checkpointing.collectives import any_rank
from megatron.training.checkpointing.durable import write_durably
from megatron.training.checkpointing.errors import CheckpointContentError, CheckpointMismatchError
from megatron.training.checkpointing.layout import (
    RANK_DIR_PREFIX,
    get_checkpoint_name,
    get_distributed_optimizer_checkpoint_name,
    rank_dirnames,
    writes_legacy_file,
)
from megatron.training.checkpointing.state import (
    check_checkpoint_args,
    generate_state_dict,
    is_distributed_optimizer,
    saved_args,
    set_checkpoint_version,
    set_rng_state,
)
from megatron.training.config.training_config import CheckpointConfig
from megatron.training.utils import print_rank_0


def write_torch_format(args, cfg: CheckpointConfig, tmp_dir, final_dir, model, optimizer, opt_param_scheduler,
                       rng_state, state):
    """Write this (tp, pp) rank's ``model_optim_rng.pt`` (and ``distrib_optim.pt``) of ``state.iteration`` into
    ``tmp_dir``, which becomes ``final_dir``; all ranks call it, data-parallel rank 0 writes. ``args`` is what
    generate_state_dict stores (sanitized)."""
    # The distributed optimizer's shards are gathered to data-parallel rank 0 (a collective).
    param_state = None
    if is_distributed_optimizer(optimizer) and cfg.save_optim:
        param_state = optimizer.get_parameter_state_dp_zero()
    if writes_legacy_file():
        final_name = get_checkpoint_name(os.path.dirname(final_dir), state.iteration)
        tmp_name = os.path.join(tmp_dir, os.path.relpath(final_name, final_dir))
        state_dict = generate_state_dict(args, model, optimizer, opt_param_scheduler, rng_state, state.iteration,
                                         state.num_floating_point_operations_so_far, state)
        write_durably(state_dict, tmp_name)
        if param_state is not None:
            write_durably(param_state, get_distributed_optimizer_checkpoint_name(tmp_name))


def _layout_hint(iteration_dir):
    found = rank_dirnames(iteration_dir)
    return ", ".join(found) if found else f"no {RANK_DIR_PREFIX}* directories"


def legacy_checkpoint_file(iteration_dir, iteration, release):
    """This rank's ``model_optim_rng.pt`` in a torch-format iteration directory (FileNotFoundError naming it)."""
    name = get_checkpoint_name(os.path.dirname(iteration_dir), iteration, release)
    if not os.path.isfile(name):
        raise FileNotFoundError(
            f"checkpoint file {name} does not exist: expected for tensor-parallel rank "
            f"{parallel_state.get_tensor_model_parallel_rank()} of "
            f"{parallel_state.get_tensor_model_parallel_world_size()} and pipeline rank "
            f"{parallel_state.get_pipeline_model_parallel_rank()} of "
            f"{parallel_state.get_pipeline_model_parallel_world_size()} (expert-parallel rank "
            f"{parallel_state.get_expert_model_parallel_rank()} of "
            f"{parallel_state.get_expert_model_parallel_world_size()}), but {iteration_dir} holds "
            f"{_layout_hint(iteration_dir)}; it was saved with a different tensor/pipeline/expert-parallel layout "
            "(the torch format cannot reshard: tools/checkpoint/convert.py can)")
    return name


def _check_layout(checkpoint_args, checkpoint_name):
    for name, current in (("tensor_model_parallel_size", parallel_state.get_tensor_model_parallel_world_size()),
                          ("pipeline_model_parallel_size", parallel_state.get_pipeline_model_parallel_world_size()),
                          ("expert_model_parallel_size", parallel_state.get_expert_model_parallel_world_size())):
        saved = getattr(checkpoint_args, name, None)
        if saved is not None and saved != current:
            flag = "--" + name.replace("_", "-")
            raise CheckpointMismatchError(f"checkpoint {checkpoint_name} was saved with {flag} {saved} but this run uses "
                             f"{current}; the torch format cannot reshard, use {flag} {saved}")


def load_torch_format(cfg: CheckpointConfig, checkpoint_name, iteration, release, context, model, optimizer,
                      opt_param_scheduler, strict, restored, mixed_precision=False, data_parallel_random_init=False):
    """Load a legacy per-rank file into model, optimizer, scheduler, RNG and ``restored``; returns the iteration.

    ``mixed_precision`` (--fp16 or --bf16): fresh fp32 main params are rebuilt from the loaded weights when the
    optimizer state is not loaded; ``data_parallel_random_init``: each data-parallel rank restores its own RNG.
    """
    state_dict = load_torch_file(checkpoint_name, context)
    checkpoint_args = saved_args(state_dict, checkpoint_name, context)
    set_checkpoint_version(state_dict.get("checkpoint_version", 0))

    if checkpoint_args is not None:
        _check_layout(checkpoint_args, checkpoint_name)

    if cfg.finetune or release:
        iteration = 0
    else:
        try:
            iteration = state_dict["iteration"]
        except KeyError:
            raise CheckpointContentError(f"checkpoint {checkpoint_name} has no 'iteration' entry; load it with "
                                         "--finetune to start from iteration 0") from None

    if cfg.finetune:
        num_floating_point_operations_so_far = 0
    else:
        if checkpoint_args is not None:
            check_checkpoint_args(checkpoint_args)
            restored.consumed_train_samples = getattr(checkpoint_args, "consumed_train_samples", 0)
            restored.skipped_train_samples = getattr(checkpoint_args, "skipped_train_samples", 0)
            restored.consumed_valid_samples = getattr(checkpoint_args, "consumed_valid_samples", 0)
        else:
            print_rank_0("could not find arguments in the checkpoint ...")
        num_floating_point_operations_so_far = state_dict.get("num_floating_point_operations_so_far", 0)
    restored.iteration = iteration
    restored.num_floating_point_operations_so_far = num_floating_point_operations_so_far

    _load_model(model, state_dict, strict, checkpoint_name)

    if not release and not cfg.finetune and cfg.load_optim:
        try:
            if optimizer is not None:
                optimizer.load_state_dict(_named_optimizer_state(state_dict, model, optimizer, checkpoint_name))
                if is_distributed_optimizer(optimizer):
                    _load_distributed_optimizer_state(optimizer, checkpoint_name, context)
            if opt_param_scheduler is not None:
                opt_param_scheduler.load_state_dict(state_dict["opt_param_scheduler"])
        except KeyError as exc:
            raise CheckpointContentError(f"unable to load optimizer state ({exc} missing) from checkpoint {checkpoint_name}; "
                                         "specify --no-load-optim or --finetune to skip it") from None
    elif mixed_precision and optimizer is not None and hasattr(optimizer, "reload_model_params"):
        # Fresh fp32 main params must start from the loaded (low-precision) weights.
        optimizer.reload_model_params()

    if not release and not cfg.finetune and cfg.load_rng:
        try:
            rng_states = state_dict["rng_state"]
            index = 0
            if data_parallel_random_init and len(rng_states) > 1:
                index = parallel_state.get_data_parallel_rank()
            set_rng_state(rng_states[index], checkpoint_name)
        except (KeyError, IndexError) as exc:
            raise CheckpointContentError(f"unable to load rng state ({exc} missing) from checkpoint {checkpoint_name}; "
                                         "specify --no-load-rng or --finetune to skip it") from None

    return iteration


def _load_distributed_optimizer_state(optimizer, checkpoint_name, context):
    """Read ``distrib_optim.pt`` on data-parallel rank 0 and scatter it to the shards (all ranks call it)."""
    name = get_distributed_optimizer_checkpoint_name(checkpoint_name)
    param_state, error = None, None
    if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
        try:
            if not os.path.isfile(name):
                raise FileNotFoundError(f"distributed-optimizer state {name} ({context}) does not exist; it is "
                                        "written by --use-distributed-optimizer runs (specify --no-load-optim to "
                                        "start the optimizer afresh)")
            param_state = load_torch_file(name, context)
        except Exception as exc:  # every rank must learn of it, or the others wait in the scatter
            error = exc
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise CheckpointContentError(f"reading the distributed-optimizer state {name} failed on data-parallel rank 0")
    optimizer.load_parameter_state_from_dp_zero(param_state, source=name)


def _named_optimizer_state(state_dict, model, optimizer, checkpoint_name):
    """The checkpoint's optimizer state keyed by param name (Megatron's positional layout mapped by name)."""
    names = getattr(optimizer, "param_names_by_group", lambda: None)()
    identities = [legacy_optimizer_state.group_identity(group) for group in getattr(optimizer, "param_groups", [])]
    return legacy_optimizer_state.to_named_layout(
        state_dict["optimizer"], names, identities, legacy_optimizer_state.model_keys_in_order(state_dict, len(model)),
        legacy_optimizer_state.param_shapes_by_name(model), checkpoint_name)


def _load_model(model, state_dict, strict, checkpoint_name):
    keys = ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]
    for chunk, key in zip(model, keys):
        if key not in state_dict:
            raise CheckpointContentError(f"checkpoint {checkpoint_name} has no '{key}' entry for {len(model)} model chunk(s)")
        try:
            chunk.load_state_dict(state_dict[key], strict=strict)
        except RuntimeError as exc:
            raise CheckpointContentError(f"checkpoint {checkpoint_name} does not match the model: {exc}") from exc
