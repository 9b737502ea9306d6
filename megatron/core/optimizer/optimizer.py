"""Optimizer wrappers: fp32 (grads from main_grad) and fp16/bf16 with fp32 main params and loss scaling."""
import logging
from abc import ABC, abstractmethod
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.collective_device import get_collective_device

from .clip_grads import (
    to_local_if_dtensor,
    clip_grad_by_total_norm_fp32,
    count_zeros_fp32,
    get_grad_norm_fp32,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from .grad_scaler import MegatronGradScaler
from .optimizer_config import OptimizerConfig

logger = logging.getLogger(__name__)

# Attributes that describe how a param is split or shared; fp32 main copies must carry them so that
# grad-norm and zero counting treat the copy exactly like the model param.
_PARAM_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel",
                     "shared", "allreduce", "is_embedding_or_output_parameter")


def _copy_param_attributes(destination: torch.Tensor, source: torch.Tensor):
    for name in _PARAM_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def multi_tensor_copy(destinations: List[torch.Tensor], sources: List[torch.Tensor]) -> None:
    """``destinations[i].copy_(sources[i])`` for all i (casting dtypes) in one ``torch._foreach_copy_`` call.

    On CUDA that is a handful of multi-tensor kernel launches for the whole model instead of one per
    param; same values as the per-param copies. Raises RuntimeError if the lists' shapes differ.
    """
    if destinations:
        # FSDP2's DTensor shards: copy local shard to local shard (DTensor has no foreach copy).
        destinations, sources = [to_local_if_dtensor(t) for t in destinations], [to_local_if_dtensor(t) for t in sources]
        torch._foreach_copy_(destinations, sources)


def _zero_grad_group_helper(group: List[torch.nn.Parameter], set_to_none: bool):
    for param in group:
        if param.grad is None:
            continue
        if set_to_none:
            param.grad = None
        else:
            if param.grad.grad_fn is not None:
                param.grad.detach_()
            else:
                param.grad.requires_grad_(False)
            param.grad.zero_()


class MegatronOptimizer(ABC):
    """Base wrapper around a ``torch.optim`` optimizer: grad norm, clipping, zero counting, loss scale.

    Args:
        optimizer: the inner torch optimizer (its ``param_groups`` are exposed unchanged).
        config: the optimizer options (``clip_grad``, ``log_num_zeros_in_grad``, ``timers``).
        init_state_fn: fills empty optimizer state for a param (used by checkpoint loaders).
        param_names: fully qualified name of each param of ``optimizer``; with it the inner state dict
            is saved keyed by name instead of position (:meth:`inner_state_dict_by_name`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 init_state_fn: Callable = lambda x: None,
                 param_names: Optional[Dict[torch.nn.Parameter, str]] = None):
        self.optimizer = optimizer
        self.config = config
        self.init_state_fn = init_state_fn
        # Called with the global grad norm (None when not computed: no clipping, or an fp16 overflow)
        # before the inner step; may raise to stop the update (the training loop's deferred NaN check).
        self.grad_norm_check: Optional[Callable[[Optional[float]], None]] = None
        # Set by get_megatron_optimizer for a mixture-of-experts model (the same on every rank): the grad norm,
        # zero count and found-inf then count expert grads (``allreduce = False``) over the expert groups.
        self.has_expert_params = False
        self._group_param_names: Optional[List[List[str]]] = None
        if param_names is not None:
            groups = [[param_names.get(p) for p in group["params"]] for group in optimizer.param_groups]
            if all(name is not None for names in groups for name in names):
                self._group_param_names = groups

    def param_names_by_group(self) -> Optional[List[List[str]]]:
        """The fully qualified param names of each param group (None when built without names)."""
        return self._group_param_names

    def inner_state_dict_by_name(self) -> Dict:
        """The inner optimizer's state dict with params named, not numbered.

        ``{'state': {name: {...}}, 'param_groups': [{..., 'params': [name, ...]}]}``; positional
        (torch's layout) when the optimizer was built without names.
        """
        inner = self.optimizer.state_dict()
        if self._group_param_names is None:
            return inner
        index_to_name = {}
        for group, names in zip(inner["param_groups"], self._group_param_names):
            index_to_name.update(zip(group["params"], names))
        return {
            "state": {index_to_name[index]: value for index, value in inner["state"].items()},
            "param_groups": [{**group, "params": [index_to_name[i] for i in group["params"]]}
                             for group in inner["param_groups"]],
        }

    def load_inner_state_dict(self, state_dict: Dict):
        """Load a name-keyed (:meth:`inner_state_dict_by_name`) or positional inner state dict.

        Names are matched group by group, whatever their order in the checkpoint.

        Raises:
            ValueError: the names of a group differ from this optimizer's, the group counts differ,
                or the state is name-keyed but this optimizer has no names.
        """
        saved_groups = state_dict["param_groups"]
        if not any(isinstance(p, str) for group in saved_groups for p in group["params"]):
            self.optimizer.load_state_dict(state_dict)
            return
        if self._group_param_names is None:
            raise ValueError("the optimizer state is keyed by param name but this optimizer was built without names")
        if len(saved_groups) != len(self._group_param_names):
            raise ValueError(f"checkpoint optimizer has {len(saved_groups)} param groups, this optimizer has "
                             f"{len(self._group_param_names)}")
        name_to_index, index = {}, 0
        for names in self._group_param_names:
            for name in names:
                name_to_index[name] = index
                index += 1
        # Group i of this optimizer takes the saved group holding its params, wherever the saver put it
        # (group order has changed between versions, e.g. the default group is no longer moved first).
        saved_by_names = {frozenset(saved["params"]): saved for saved in saved_groups}
        positional_groups = []
        for group_index, names in enumerate(self._group_param_names):
            saved = saved_groups[group_index]  # same place first: empty groups are told apart only by it
            if set(saved["params"]) != set(names):
                saved = saved_by_names.get(frozenset(names), saved)
            if set(saved["params"]) != set(names):
                missing = sorted(set(names) - set(saved["params"]))[:3]
                extra = sorted(set(saved["params"]) - set(names))[:3]
                raise ValueError(f"optimizer param group {group_index} in the checkpoint does not hold this model's "
                                 f"params (missing {missing}, unexpected {extra})")
            positional_groups.append({**saved, "params": [name_to_index[name] for name in names]})
        self.optimizer.load_state_dict({
            "state": {name_to_index[name]: value for name, value in state_dict["state"].items()},
            "param_groups": positional_groups,
        })

    def _timer(self, name: str):
        timers = self.config.timers
        return None if timers is None else timers(name, log_level=1)

    def _start_timer(self, name: str):
        timer = self._timer(name)
        if timer is not None:
            timer.start(barrier=getattr(self.config, "barrier_with_L1_time", False))
        return timer

    def get_parameters(self) -> List[torch.nn.Parameter]:
        """The params the inner optimizer updates (fp32 main params for mixed precision)."""
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def get_main_grads_for_grad_norm(self, expert: Optional[bool] = None) -> List[torch.Tensor]:
        """Grads that count towards the norm: not ``shared``, and TP-partitioned or on TP rank 0 (the expert TP rank
        for expert params). ``expert``: None for all params, True / False for expert (``allreduce = False``) /
        dense params only."""
        from .clip_grads import _expert_tp_rank, _tp_rank

        tp_rank = _tp_rank()
        expert_tp_rank = _expert_tp_rank() if self.has_expert_params else tp_rank
        grads = []
        for p in self.get_parameters():
            is_expert = not getattr(p, "allreduce", True)
            if p.grad is None or not param_is_not_shared(p) or (expert is not None and expert != is_expert):
                continue
            if param_is_not_tensor_parallel_duplicate(p, expert_tp_rank if is_expert else tp_rank):
                grads.append(p.grad)
        return grads

    def get_grad_stats_parallel_group(self):
        """Group over which grad norm, found-inf and zero counts are reduced (model-parallel = tp x pp)."""
        from megatron.core import parallel_state

        if not dist.is_initialized():
            return None
        if dist.get_world_size() == 1 and not parallel_state.model_parallel_is_initialized():
            return None
        return parallel_state.get_model_parallel_group()

    def get_expert_grad_stats_parallel_group(self):
        """Group over which the expert grads' norm and zero count are reduced: expert TP x EP x PP (Megatron's
        expert optimizer uses ``get_expert_tensor_model_pipeline_parallel_group``); None without expert params or
        when the grad-stats group already spans every rank (the distributed optimizer)."""
        from megatron.core import parallel_state

        group = self.get_grad_stats_parallel_group()
        if not self.has_expert_params or group is None or group is dist.group.WORLD:
            return None
        return parallel_state.get_expert_tensor_model_pipeline_parallel_group()

    def get_grad_norm(self) -> float:
        """Global L2 norm of the counted main grads.

        With expert params (and no distributed optimizer) as Megatron's chained dense + expert optimizers: the dense
        norm over the model-parallel group and the expert norm over the expert tensor-model-pipeline group, combined
        as sqrt(dense^2 + expert^2), so each expert param counts once.
        """
        expert_group = self.get_expert_grad_stats_parallel_group()
        if expert_group is None:
            return get_grad_norm_fp32(self.get_main_grads_for_grad_norm(),
                                      model_parallel_group=self.get_grad_stats_parallel_group())
        dense = get_grad_norm_fp32(self.get_main_grads_for_grad_norm(expert=False),
                                   model_parallel_group=self.get_grad_stats_parallel_group())
        experts = get_grad_norm_fp32(self.get_main_grads_for_grad_norm(expert=True), model_parallel_group=expert_group)
        return (dense ** 2 + experts ** 2) ** 0.5

    def clip_grad_norm(self, clip_grad: float) -> float:
        """Clip all grads to global norm ``clip_grad``; returns the norm before clipping."""
        grad_norm = self.get_grad_norm()
        clip_grad_by_total_norm_fp32(self.get_parameters(), clip_grad, grad_norm)
        return grad_norm

    def count_zeros(self) -> int:
        """Zero entries in the counted grads, summed over the grad-stats group (expert params: over the expert
        grad-stats group, counted on expert TP rank 0 when replicated)."""
        expert_group = self.get_expert_grad_stats_parallel_group()
        if expert_group is None:
            return count_zeros_fp32(self.get_parameters(), self.get_grad_stats_parallel_group())
        from .clip_grads import _expert_tp_rank

        params = self.get_parameters()
        dense = [p for p in params if getattr(p, "allreduce", True)]
        experts = [p for p in params if not getattr(p, "allreduce", True)]
        return (count_zeros_fp32(dense, self.get_grad_stats_parallel_group())
                + count_zeros_fp32(experts, expert_group, tp_rank=_expert_tp_rank()))

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scale`` (what backward is run on)."""
        return self.get_loss_scale() * loss

    @abstractmethod
    def get_loss_scale(self) -> torch.Tensor:
        """Current loss scale, a ``[1]`` fp32 tensor."""

    @abstractmethod
    def zero_grad(self, set_to_none: bool = True):
        """Clear the grads of model and main params."""

    @abstractmethod
    def reload_model_params(self):
        """Refresh main params from the model params (after the model was loaded from a checkpoint)."""

    @abstractmethod
    def state_dict(self) -> Dict:
        """Checkpointable state."""

    @abstractmethod
    def load_state_dict(self, state_dict: Dict):
        """Restore :meth:`state_dict` output."""

    @abstractmethod
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """One update; returns ``(update_successful, grad_norm, num_zeros_in_grad)``."""

    @property
    def param_groups(self) -> List[Dict]:
        """The inner optimizer's param groups (lr / weight_decay are set here by the scheduler)."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict]):
        self.optimizer.param_groups = value

    @property
    def state(self):
        """The inner optimizer's per-param state."""
        return self.optimizer.state

    def main_param_copies(self) -> List[torch.Tensor]:
        """fp32 main params held *in addition to* the model params (none when the optimizer updates
        the model params, or views of them, directly)."""
        return []

    def _main_param_step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """The update of an optimizer that keeps fp32 main params apart from the model params (the
        mixed-precision and the distributed optimizers): model grads -> main grads, unscale and skip on
        overflow, clip / count / inner step, main params -> model params. Subclasses provide the three
        copy/unscale methods. Returns ``(False, None, None)`` on overflow, else ``(True, grad_norm, num_zeros)``."""
        timer = self._start_timer("optimizer-copy-to-main-grad")
        self._copy_model_grads_to_main_grads()
        if timer is not None:
            timer.stop()
        if self.grad_scaler is not None:
            timer = self._start_timer("optimizer-unscale-and-check-inf")
            found_inf = self._unscale_main_grads_and_check_for_nan()
            if timer is not None:
                timer.stop()
            self.grad_scaler.update(found_inf)
            if found_inf:
                self._check_grad_norm(None)
                return False, None, None
        grad_norm, num_zeros = self._clip_count_and_step()
        timer = self._start_timer("optimizer-copy-main-to-model-params")
        self._copy_main_params_to_model_params()
        if timer is not None:
            timer.stop()
        return True, grad_norm, num_zeros

    def _check_grad_norm(self, grad_norm: Optional[float]):
        if self.grad_norm_check is not None:
            self.grad_norm_check(grad_norm)

    def _clip_count_and_step(self) -> Tuple[float, Optional[int]]:
        timer = self._start_timer("optimizer-clip-main-grad")
        grad_norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0.0 else None
        if timer is not None:
            timer.stop()
        self._check_grad_norm(grad_norm)
        grad_norm = 0.0 if grad_norm is None else grad_norm
        timer = self._start_timer("optimizer-count-zeros")
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        if timer is not None:
            timer.stop()
        timer = self._start_timer("optimizer-inner-step")
        self.optimizer.step()
        if timer is not None:
            timer.stop()
        return grad_norm, num_zeros


class FP32Optimizer(MegatronOptimizer):
    """Plain fp32 training: the inner optimizer reads ``param.main_grad`` (no loss scale, scale 1.0)."""

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 init_state_fn: Callable = lambda x: None,
                 param_names: Optional[Dict[torch.nn.Parameter, str]] = None):
        super().__init__(optimizer, config, init_state_fn, param_names)
        params = self.get_parameters()
        device = params[0].device if params else torch.device("cpu")
        self._scale = torch.tensor([1.0], dtype=torch.float, device=device)

    def zero_grad(self, set_to_none: bool = True):
        """Clear ``param.grad`` of every optimized param."""
        for group in self.optimizer.param_groups:
            _zero_grad_group_helper(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        """Always 1.0."""
        return self._scale

    def prepare_grads(self):
        """Point ``param.grad`` at the DDP buffer's ``main_grad`` (no copy: same dtype)."""
        timer = self._start_timer("optimizer-copy-to-main-grad")
        for param in self.get_parameters():
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = main_grad if main_grad.dtype == param.dtype else main_grad.to(param.dtype)
        if timer is not None:
            timer.stop()

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """Clip, optionally count zeros, step. Returns ``(True, grad_norm, num_zeros or None)``.

        A non-finite grad norm is returned as is (the caller counts it as a NaN iteration).
        """
        self.prepare_grads()
        grad_norm, num_zeros = self._clip_count_and_step()
        return True, grad_norm, num_zeros

    def reload_model_params(self):
        """Nothing to do: the optimizer updates the model params directly."""

    def state_dict(self) -> Dict:
        """The inner optimizer's state dict, keyed by param name when names are known."""
        return self.inner_state_dict_by_name()

    def load_state_dict(self, state_dict: Dict):
        """Load the inner optimizer's state dict (name-keyed or positional)."""
        self.load_inner_state_dict(state_dict)


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """fp16/bf16 model params with fp32 main copies that the inner optimizer updates.

    Step: copy model grads (``main_grad`` or ``grad``) to fp32 main grads; with a grad scaler,
    unscale them, check for Inf/NaN (all-reduce MAX over the model-parallel group), update the
    scaler and skip the step on overflow; clip; inner step; copy main params back to the model.
    (Micikevicius et al., "Mixed Precision Training", ICLR 2018, section 3.)

    Args:
        optimizer: inner optimizer built over the model params; its groups are rewritten in place to
            hold the fp32 main copies of fp16/bf16 params (fp32 params are used directly).
        config: optimizer options.
        grad_scaler: None (bf16 without ``--loss-scale``) or a :class:`MegatronGradScaler`.
        init_state_fn: fills empty optimizer state for a param.

    Raises:
        ValueError: fp16 without a grad scaler.
        TypeError: a param is neither fp32, fp16 nor bf16.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, config: OptimizerConfig,
                 grad_scaler: Optional[MegatronGradScaler], init_state_fn: Callable = lambda x: None,
                 param_names: Optional[Dict[torch.nn.Parameter, str]] = None):
        super().__init__(optimizer, config, init_state_fn, param_names)
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a grad scaler (constant --loss-scale or dynamic)")
        self.grad_scaler = grad_scaler
        self.float16_groups: List[List[torch.nn.Parameter]] = []
        self.fp32_from_float16_groups: List[List[torch.nn.Parameter]] = []
        self.fp32_from_fp32_groups: List[List[torch.nn.Parameter]] = []
        device = None
        for group_index, param_group in enumerate(self.optimizer.param_groups):
            float16_params, fp32_from_float16_params, fp32_params = [], [], []
            for i, param in enumerate(param_group["params"]):
                if not param.requires_grad:
                    continue
                device = param.device if device is None else device
                if param.dtype in (torch.float16, torch.bfloat16):
                    main_param = torch.nn.Parameter(param.detach().clone().float())
                    _copy_param_attributes(main_param, param)
                    param_group["params"][i] = main_param
                    float16_params.append(param)
                    fp32_from_float16_params.append(main_param)
                    if param in self.optimizer.state:
                        self.optimizer.state[main_param] = self.optimizer.state.pop(param)
                elif param.dtype == torch.float32:
                    fp32_params.append(param)
                else:
                    raise TypeError(
                        f"param {i} of param group {group_index} has dtype {param.dtype}; wrapped params "
                        f"must be torch.float32, torch.float16 or torch.bfloat16"
                    )
            self.float16_groups.append(float16_params)
            self.fp32_from_float16_groups.append(fp32_from_float16_params)
            self.fp32_from_fp32_groups.append(fp32_params)
        device = torch.device("cpu") if device is None else device
        self.found_inf = torch.zeros(1, dtype=torch.float, device=device)
        self._scale_one = torch.ones(1, dtype=torch.float, device=device)
        if self.grad_scaler is not None:
            # The loss is multiplied by the scale, so it lives with the model.
            self.grad_scaler.to(device)

    def main_param_copies(self) -> List[torch.Tensor]:
        """The fp32 main copies of the fp16/bf16 model params."""
        return [p for group in self.fp32_from_float16_groups for p in group]

    def zero_grad(self, set_to_none: bool = True):
        """Clear grads of model params, fp32 main params and fp32 params."""
        for groups in (self.float16_groups, self.fp32_from_float16_groups, self.fp32_from_fp32_groups):
            for group in groups:
                _zero_grad_group_helper(group, set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        """The scaler's scale, or 1.0 without a scaler."""
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _copy_model_grads_to_main_grads(self):
        for model_group, main_group in zip(self.float16_groups, self.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                main_grad = getattr(model_param, "main_grad", None)
                grad = model_param.grad if main_grad is None else main_grad
                main_param.grad = None if grad is None else grad.float()
                # The model param's own grad is no longer needed once copied.
                model_param.grad = None
        for model_group in self.fp32_from_fp32_groups:
            for model_param in model_group:
                main_grad = getattr(model_param, "main_grad", None)
                if main_grad is not None:
                    model_param.grad = main_grad.float()

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        main_grads = [p.grad for p in self.get_parameters() if p.grad is not None]
        self.found_inf.fill_(0.0)
        if main_grads:
            inv_scale = self.grad_scaler.inv_scale.to(main_grads[0].device)
            torch._amp_foreach_non_finite_check_and_unscale_(main_grads, self.found_inf, inv_scale)
        found_inf = self.found_inf
        group = self.get_grad_stats_parallel_group()
        if group is not None:
            # found_inf lives with the grads (the unscale kernel needs that); the reduction may need
            # another device (a CUDA model over gloo). .to() is free when they agree.
            found_inf = found_inf.to(get_collective_device(group))
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        expert_group = self.get_expert_grad_stats_parallel_group()
        if expert_group is not None:  # an Inf in another expert-parallel rank's experts skips this step too
            found_inf = found_inf.to(get_collective_device(expert_group))
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=expert_group)
        return bool(found_inf.item() > 0)

    def _model_and_main_data(self) -> Tuple[List[torch.Tensor], List[torch.Tensor]]:
        model = [p.data for group in self.float16_groups for p in group]
        main = [p.data for group in self.fp32_from_float16_groups for p in group]
        return model, main

    def _copy_main_params_to_model_params(self):
        # One multi-tensor launch (with the fp32 -> fp16/bf16 cast) instead of one copy per param.
        model, main = self._model_and_main_data()
        multi_tensor_copy(model, main)

    def _copy_model_params_to_main_params(self):
        model, main = self._model_and_main_data()
        multi_tensor_copy(main, model)

    def reload_model_params(self):
        """Copy the (freshly loaded) model params into the fp32 main params."""
        self._copy_model_params_to_main_params()

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """One mixed-precision update.

        Returns:
            ``(False, None, None)`` when the grads overflowed (step skipped, scaler backed off), else
            ``(True, grad_norm, num_zeros or None)``.
        """
        return self._main_param_step()

    def state_dict(self) -> Dict:
        """``{'optimizer', 'grad_scaler' (if any), 'fp32_from_fp16_params'}``."""
        state_dict = {"optimizer": self.inner_state_dict_by_name()}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        state_dict["fp32_from_fp16_params"] = [[p.detach() for p in group] for group in self.fp32_from_float16_groups]
        return state_dict

    def load_state_dict(self, state_dict: Dict):
        """Restore optimizer state, scaler and fp32 main params.

        Raises:
            KeyError: 'optimizer' or 'fp32_from_fp16_params' is missing.
            ValueError: the saved main params do not match this optimizer's groups in count or shape.
        """
        self.load_inner_state_dict(state_dict["optimizer"])
        if "grad_scaler" not in state_dict:
            if self.config.fp16:
                logger.warning("***WARNING*** found an old checkpoint, will not load grad scaler ...")
        elif self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        else:
            logger.warning("***WARNING*** found the grad scaler in the checkpoint but it is None in the "
                           "class. Skipping loading grad scaler ...")
        saved_groups = state_dict["fp32_from_fp16_params"]
        if len(saved_groups) != len(self.fp32_from_float16_groups):
            raise ValueError(f"checkpoint has {len(saved_groups)} fp32_from_fp16_params groups, "
                             f"optimizer has {len(self.fp32_from_float16_groups)}")
        for index, (current_group, saved_group) in enumerate(zip(self.fp32_from_float16_groups, saved_groups)):
            if len(current_group) != len(saved_group):
                raise ValueError(f"fp32_from_fp16_params group {index}: checkpoint has {len(saved_group)} "
                                 f"params, optimizer has {len(current_group)}")
            for current, saved in zip(current_group, saved_group):
                if current.shape != saved.shape:
                    raise ValueError(f"fp32_from_fp16_params group {index}: shape {tuple(saved.shape)} in "
                                     f"checkpoint vs {tuple(current.shape)} in the optimizer")
                current.data.copy_(saved.data)
