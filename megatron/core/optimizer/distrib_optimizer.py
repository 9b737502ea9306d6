"""Distributed optimizer: fp32 main params and Adam state sharded over data-parallel ranks by buffer range."""
import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from megatron.core.collective_device import get_collective_device

from .grad_scaler import MegatronGradScaler
from .optimizer import MegatronOptimizer, _copy_param_attributes, _zero_grad_group_helper, multi_tensor_copy
from .optimizer_config import OptimizerConfig

logger = logging.getLogger(__name__)

# Per-param state tensors the legacy ``distrib_optim.pt`` holds (Megatron's names).
_STATE_KEYS = ("param", "exp_avg", "exp_avg_sq")


@dataclass
class _ShardPiece:
    """The part of one model param that lies in this rank's shard of its bucket.

    ``param_start/param_end`` index the flattened param; ``shard_start/shard_end`` index this rank's
    shard of the bucket (Megatron's "gbuf_local" range). ``main_param`` is the fp32 tensor the inner
    optimizer updates: a view into the param buffer for fp32 params, a copy for fp16/bf16 ones.
    """

    model_param: torch.nn.Parameter
    name: str
    buffer_index: int
    bucket_index: int
    param_start: int
    param_end: int
    shard_start: int
    shard_end: int
    main_param: torch.Tensor
    is_copy: bool

    def model_shard(self) -> torch.Tensor:
        """``[param_end - param_start]`` view of the model param (inside the param buffer)."""
        return self.model_param.detach().view(-1)[self.param_start:self.param_end]

    def model_grad_shard(self) -> torch.Tensor:
        """``[param_end - param_start]`` view of the param's ``main_grad`` (inside the grad buffer)."""
        return self.model_param.main_grad.view(-1)[self.param_start:self.param_end]


def _unwrapped_named_parameters(chunk: torch.nn.Module):
    while isinstance(getattr(chunk, "module", None), torch.nn.Module):
        chunk = chunk.module
    return chunk.named_parameters()


class DistributedOptimizer(MegatronOptimizer):
    """Adam whose fp32 main params and moments exist only for this data-parallel rank's shard.

    Every bucket of every DDP buffer is split into dp equal contiguous shards (ignoring param
    boundaries; the buffer pads buckets so they split evenly) and rank r owns shard r. For each
    piece of a param inside the owned shard the inner optimizer holds one 1-D fp32 main param:
    a view into the param buffer for fp32 params, an fp32 copy for fp16/bf16 params. Adam's
    ``exp_avg`` / ``exp_avg_sq`` follow the main params, so each rank holds 1/dp of them
    (ZeRO stage 2: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
    Parameter Models", SC 2020, section 5.1; Megatron-LM's ``DistributedOptimizer``).

    Step: the DDP wrapper has already reduce-scattered the grads (``finalize_model_grads``); the
    main grads are this rank's shard of the grad buffer; with a grad scaler they are unscaled and
    checked for Inf/NaN (found_inf all-reduced MAX over all ranks); the grad norm sums the squares
    of the disjoint shards over all ranks (no double counting), clipping scales the shards; the
    inner optimizer steps; fp16/bf16 main params are copied into the model shard; and the updated
    shards are all-gathered into the param buffer, now (timer ``params-all-gather``) or, with
    ``overlap_param_gather``, bucket by bucket in the next forward's pre-hooks.

    Args:
        config: optimizer options.
        model_chunks: the DistributedDataParallel-wrapped chunks (their ``buffers`` and ``bucket_groups``).
        param_groups: param groups over the model params (from ``_get_param_groups``).
        make_inner: ``f(shard param groups) -> torch.optim.Optimizer`` (AdamW).
        grad_scaler: None (fp32 / bf16) or a :class:`MegatronGradScaler`.
        init_state_fn: fills empty optimizer state for a main param.

    Raises:
        ValueError: a chunk is not wrapped in DistributedDataParallel built with
            ``use_distributed_optimizer``, or fp16 without a grad scaler.
    """

    def __init__(self, config: OptimizerConfig, model_chunks: List[torch.nn.Module], param_groups: List[Dict],
                 make_inner: Callable[[List[Dict]], torch.optim.Optimizer],
                 grad_scaler: Optional[MegatronGradScaler], init_state_fn: Callable = lambda x: None):
        if grad_scaler is None and config.fp16:
            raise ValueError("fp16 training needs a grad scaler (constant --loss-scale or dynamic)")
        self.model_chunks = list(model_chunks)
        self.buffers = []
        param_to_name: Dict[torch.nn.Parameter, str] = {}
        for index, chunk in enumerate(self.model_chunks):
            ddp_config = getattr(chunk, "ddp_config", None)
            if ddp_config is None or not ddp_config.use_distributed_optimizer:
                raise ValueError("--use-distributed-optimizer needs every model chunk wrapped in "
                                 "DistributedDataParallel built with use_distributed_optimizer=True")
            self.buffers.extend(chunk.buffers)
        # Expert-parallel buffers after all dense ones (Megatron chains a second optimizer for them); each is
        # sharded over its own group, the expert-data-parallel group.
        for chunk in self.model_chunks:
            self.buffers.extend(getattr(chunk, "expert_parallel_buffers", []))
        for index, chunk in enumerate(self.model_chunks):
            prefix = f"model{index}." if len(self.model_chunks) > 1 else ""
            for name, param in _unwrapped_named_parameters(chunk):
                param_to_name.setdefault(param, prefix + name)
        self.ddp_config = self.model_chunks[0].ddp_config
        self.data_parallel_group = self.model_chunks[0].data_parallel_group
        self.data_parallel_rank = dist.get_rank(self.data_parallel_group)
        self.data_parallel_world_size = dist.get_world_size(self.data_parallel_group)

        pieces_by_param = self._build_pieces(param_to_name)
        self.pieces_by_group: List[List[_ShardPiece]] = []
        shard_groups = []
        for group in param_groups:
            pieces = [pieces_by_param[p] for p in group["params"] if p in pieces_by_param]
            self.pieces_by_group.append(pieces)
            shard_groups.append({**{k: v for k, v in group.items() if k != "params"},
                                 "params": [piece.main_param for piece in pieces]})
        super().__init__(make_inner(shard_groups), config, init_state_fn)
        self.grad_scaler = grad_scaler
        device = self.buffers[0].grad_data.device
        self.found_inf = torch.zeros(1, dtype=torch.float, device=device)
        self._scale_one = torch.ones(1, dtype=torch.float, device=device)
        if grad_scaler is not None:
            grad_scaler.to(device)
        self._loaded_steps: Optional[List[float]] = None

    @staticmethod
    def _buffer_group(buffer) -> Tuple[object, int, int]:
        """(group, world size, rank) the buffer is sharded over: data-parallel with context-parallel for dense
        params, expert-data-parallel for expert params."""
        group = buffer.data_parallel_group
        return group, dist.get_world_size(group), dist.get_rank(group)

    def _build_pieces(self, param_to_name) -> Dict[torch.nn.Parameter, _ShardPiece]:
        """This rank's piece of every param that reaches into its shard of a bucket."""
        pieces = {}
        for buffer_index, buffer in enumerate(self.buffers):
            _, dp, rank = self._buffer_group(buffer)
            for bucket in buffer.buckets:
                shard_numel = bucket.grad_data.numel() // dp
                shard_lo = bucket.offset + rank * shard_numel
                shard_hi = shard_lo + shard_numel
                for param in bucket.params:
                    start, end, _ = buffer.param_index_map[param]
                    lo, hi = max(start, shard_lo), min(end, shard_hi)
                    if lo >= hi:
                        continue
                    model_shard = param.detach().view(-1)[lo - start:hi - start]
                    is_copy = param.dtype != torch.float32
                    main = model_shard.clone().float() if is_copy else model_shard
                    _copy_param_attributes(main, param)
                    pieces[param] = _ShardPiece(param, param_to_name.get(param, "?"), buffer_index, bucket.bucket_id,
                                                lo - start, hi - start, lo - shard_lo, hi - shard_lo, main, is_copy)
        return pieces

    # ----------------------------------------------------------------------------------------------
    # Step
    # ----------------------------------------------------------------------------------------------

    def pieces(self) -> List[_ShardPiece]:
        """Every piece this rank optimizes, group by group."""
        return [piece for group in self.pieces_by_group for piece in group]

    def main_param_copies(self) -> List[torch.Tensor]:
        """The fp32 copies of this rank's shard of fp16/bf16 params."""
        return [piece.main_param for piece in self.pieces() if piece.is_copy]

    def get_grad_stats_parallel_group(self):
        """All ranks: every rank holds a disjoint shard of the grads (spec §6.2); expert grads too, sharded over the
        expert-data-parallel group, so each element is counted once over the world."""
        return dist.group.WORLD

    def zero_grad(self, set_to_none: bool = True):
        """Clear the main params' grads (the model grads live in the DDP buffer, zeroed there)."""
        for group in self.optimizer.param_groups:
            _zero_grad_group_helper(group["params"], set_to_none)

    def get_loss_scale(self) -> torch.Tensor:
        """The scaler's scale, or 1.0 without a scaler."""
        return self._scale_one if self.grad_scaler is None else self.grad_scaler.scale

    def _copy_model_grads_to_main_grads(self):
        for piece in self.pieces():
            # A view for fp32 grads: clipping and unscaling then act on the grad buffer itself.
            piece.main_param.grad = piece.model_grad_shard().float()

    def _unscale_main_grads_and_check_for_nan(self) -> bool:
        main_grads = [p.grad for p in self.get_parameters() if p.grad is not None]
        self.found_inf.fill_(0.0)
        if main_grads:
            torch._amp_foreach_non_finite_check_and_unscale_(
                main_grads, self.found_inf, self.grad_scaler.inv_scale.to(main_grads[0].device))
        group = self.get_grad_stats_parallel_group()
        found_inf = self.found_inf.to(get_collective_device(group))
        # A shard on another rank may hold the Inf: every rank must skip the step together.
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)
        return bool(found_inf.item() > 0)

    def _copy_main_params_to_model_params(self):
        copies = [piece for piece in self.pieces() if piece.is_copy]
        multi_tensor_copy([piece.model_shard() for piece in copies], [piece.main_param for piece in copies])

    def _gather_model_params(self):
        for chunk in self.model_chunks:
            chunk.mark_params_stale()
        if self.ddp_config.overlap_param_gather:
            return  # the next forward's pre-hooks gather bucket by bucket
        timer = self._start_timer("params-all-gather")
        for chunk in self.model_chunks:
            chunk.start_param_sync()
        if timer is not None:
            timer.stop()

    def reload_model_params(self):
        """Copy the (freshly loaded) model params into this rank's fp32 main params."""
        copies = [piece for piece in self.pieces() if piece.is_copy]
        multi_tensor_copy([piece.main_param.data for piece in copies], [piece.model_shard() for piece in copies])

    @torch.no_grad()
    def step(self) -> Tuple[bool, Optional[float], Optional[int]]:
        """One sharded update; returns ``(False, None, None)`` on overflow, else ``(True, grad_norm, num_zeros)``."""
        for chunk in self.model_chunks:
            # A gather still in flight (a bucket no forward pre-hook waited for) must land before
            # this step rewrites the shards it reads.
            chunk.start_param_sync(force_sync=True)
        updated, grad_norm, num_zeros = self._main_param_step()
        if updated:
            self._gather_model_params()
        return updated, grad_norm, num_zeros

    # ----------------------------------------------------------------------------------------------
    # Checkpoint: small state in model_optim_rng.pt, parameter state in distrib_optim.pt
    # ----------------------------------------------------------------------------------------------

    def _group_steps(self) -> List[float]:
        """Adam's step per param group, from this rank's pieces.

        Every param steps together, so a group without a piece on this rank takes the largest step
        of the others (no communication: only data-parallel rank 0 calls :meth:`state_dict`).
        """
        steps = []
        for group in self.optimizer.param_groups:
            values = [float(self.optimizer.state[p]["step"]) for p in group["params"]
                      if "step" in self.optimizer.state.get(p, {})]
            steps.append(max(values) if values else None)
        known = [step for step in steps if step is not None]
        fallback = max(known) if known else 0.0
        return [fallback if step is None else step for step in steps]

    def state_dict(self) -> Dict:
        """Megatron's layout: ``{'optimizer': {'param_groups': [... 'step' ...]}, 'grad_scaler'?}``.

        The param groups carry their hyper-parameters and Adam's step but no params: the
        per-param tensors are in :meth:`get_parameter_state_dp_zero` (``distrib_optim.pt``).
        """
        inner = self.optimizer.state_dict()
        steps = self._group_steps()
        param_groups = []
        for group, step in zip(inner["param_groups"], steps):
            group = {k: v for k, v in group.items() if k != "params"}
            group["step"] = step
            param_groups.append(group)
        state_dict = {"optimizer": {"param_groups": param_groups}}
        if self.grad_scaler is not None:
            state_dict["grad_scaler"] = self.grad_scaler.state_dict()
        return state_dict

    def load_state_dict(self, state_dict: Dict):
        """Restore group hyper-parameters, the step and the scaler (the tensors come from
        :meth:`load_parameter_state_from_dp_zero`).

        Raises:
            ValueError: the number of param groups differs.
        """
        saved_groups = state_dict["optimizer"]["param_groups"]
        if len(saved_groups) != len(self.optimizer.param_groups):
            raise ValueError(f"checkpoint optimizer has {len(saved_groups)} param groups, this optimizer has "
                             f"{len(self.optimizer.param_groups)}")
        for group, saved in zip(self.optimizer.param_groups, saved_groups):
            for key, value in saved.items():
                if key not in ("params", "step"):
                    group[key] = value
        self._loaded_steps = [float(g.get("step", 0.0)) for g in saved_groups]
        if "grad_scaler" in state_dict and self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])
        elif self.config.fp16:
            logger.warning("***WARNING*** found an old checkpoint, will not load grad scaler ...")

    def _piece_state(self, piece: _ShardPiece) -> Dict[str, torch.Tensor]:
        state = self.optimizer.state.get(piece.main_param, {})
        tensors = {"param": piece.main_param.detach()}
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[key] = state[key] if key in state else torch.zeros_like(piece.main_param)
        return tensors

    def _pieces_of_bucket(self, buffer_index: int, bucket_index: int) -> List[_ShardPiece]:
        return [p for p in self.pieces() if p.buffer_index == buffer_index and p.bucket_index == bucket_index]

    def _param_name_ranges(self, buffer) -> Dict[str, List[int]]:
        """{param name: [start, end)} in the coordinates of the saved (bucket-padding free) tensors."""
        names = {}
        for piece in self.pieces():
            names[piece.model_param] = piece.name
        # Names of params with no piece on this rank come from the model.
        for chunk_index, chunk in enumerate(self.model_chunks):
            prefix = f"model{chunk_index}." if len(self.model_chunks) > 1 else ""
            for name, param in _unwrapped_named_parameters(chunk):
                names.setdefault(param, prefix + name)
        ranges, removed = {}, 0
        for bucket in buffer.buckets:
            for param in bucket.params:
                start, end, _ = buffer.param_index_map[param]
                ranges[names[param]] = [start - removed, end - removed]
            removed += bucket.grad_data.numel() - bucket.numel_unpadded
        return ranges

    def get_parameter_state_dp_zero(self) -> Optional[Dict]:
        """Gather the sharded main params and Adam moments to data-parallel rank 0.

        Megatron's legacy ``distrib_optim.pt`` layout ("buckets_coalesced"): ``{buffer index:
        {(param dtype, grad dtype): {'param', 'exp_avg', 'exp_avg_sq': fp32 [numel_unpadded] on the
        CPU, 'numel_unpadded': int}}}``, each tensor the concatenation of the buckets without their
        end padding; plus ``param_index_map`` ``{buffer index: {param name: [start, end)}}`` so the
        state can be resharded by name. A collective over the data-parallel group.

        Returns:
            the dict on data-parallel rank 0, None on the other ranks.
        """
        self._check_one_sharding_group()
        group = self.data_parallel_group
        dp, rank = self.data_parallel_world_size, self.data_parallel_rank
        device = get_collective_device(group)
        root = dist.get_global_rank(group, 0)
        state = {"buckets_coalesced": True, "param_index_map": {}} if rank == 0 else None
        for buffer_index, buffer in enumerate(self.buffers):
            numel_unpadded = sum(b.numel_unpadded for b in buffer.buckets)
            world = None
            if rank == 0:
                world = {key: torch.zeros(numel_unpadded, dtype=torch.float32) for key in _STATE_KEYS}
                world["numel_unpadded"] = numel_unpadded
            offset = 0
            for bucket in buffer.buckets:
                shard_numel = bucket.grad_data.numel() // dp
                local = {key: torch.zeros(shard_numel, dtype=torch.float32, device=device) for key in _STATE_KEYS}
                for piece in self._pieces_of_bucket(buffer_index, bucket.bucket_id):
                    for key, tensor in self._piece_state(piece).items():
                        local[key][piece.shard_start:piece.shard_end].copy_(tensor)
                for key in _STATE_KEYS:
                    gathered = [torch.empty_like(local[key]) for _ in range(dp)] if rank == 0 else None
                    dist.gather(local[key], gathered, dst=root, group=group)
                    if rank == 0:
                        world[key][offset:offset + bucket.numel_unpadded].copy_(
                            torch.cat(gathered)[:bucket.numel_unpadded].cpu())
                offset += bucket.numel_unpadded
            if rank == 0:
                state[buffer_index] = {(buffer.param_dtype, buffer.grad_dtype): world}
                state["param_index_map"][buffer_index] = self._param_name_ranges(buffer)
        return state

    def load_parameter_state_from_dp_zero(self, state_dict: Optional[Dict], source: str = "distrib_optim.pt"):
        """Scatter the state written by :meth:`get_parameter_state_dp_zero` from data-parallel rank 0.

        ``state_dict`` is read on data-parallel rank 0 only (None elsewhere). Adam's step is the one
        restored by :meth:`load_state_dict` (0 when that was not called). A collective over the
        data-parallel group.

        Raises:
            ValueError (on every rank): the file's buffers do not match this model's buffers
            (a different model, dtype or param set), naming ``source``.
        """
        self._check_one_sharding_group()
        group = self.data_parallel_group
        dp, rank = self.data_parallel_world_size, self.data_parallel_rank
        device = get_collective_device(group)
        root = dist.get_global_rank(group, 0)
        problem = ""
        if rank == 0:
            problem = self._layout_problem(state_dict, source)
        flag = torch.tensor([1 if problem else 0], dtype=torch.int32, device=device)
        dist.broadcast(flag, src=root, group=group)
        if flag.item():
            raise ValueError(problem or f"{source} does not match this model's buffers (see data-parallel rank 0)")
        for buffer_index, buffer in enumerate(self.buffers):
            world = state_dict[buffer_index][(buffer.param_dtype, buffer.grad_dtype)] if rank == 0 else None
            offset = 0
            for bucket in buffer.buckets:
                shard_numel = bucket.grad_data.numel() // dp
                local = {}
                for key in _STATE_KEYS:
                    chunks = None
                    if rank == 0:
                        padded = torch.zeros(bucket.grad_data.numel(), dtype=torch.float32, device=device)
                        padded[:bucket.numel_unpadded].copy_(world[key][offset:offset + bucket.numel_unpadded])
                        chunks = list(padded.chunk(dp))
                    local[key] = torch.empty(shard_numel, dtype=torch.float32, device=device)
                    dist.scatter(local[key], chunks, src=root, group=group)
                for piece in self._pieces_of_bucket(buffer_index, bucket.bucket_id):
                    self._set_piece_state(piece, {k: v[piece.shard_start:piece.shard_end] for k, v in local.items()})
                offset += bucket.numel_unpadded

    def _check_one_sharding_group(self):
        """The legacy ``distrib_optim.pt`` gathers every buffer to data-parallel rank 0: refuse (on every rank
        alike, the layout being global) expert buffers sharded over another group (expert parallelism, or an
        expert tensor-parallel size other than the dense one).

        Raises:
            ValueError: naming --ckpt-format torch_dist, which saves each rank's shards itself.
        """
        dense = dist.get_process_group_ranks(self.data_parallel_group)
        for buffer in self.buffers:
            if dist.get_process_group_ranks(buffer.data_parallel_group) != dense:
                raise ValueError("the legacy distributed-optimizer state (--ckpt-format torch, distrib_optim.pt) "
                                 "cannot hold expert parameters sharded over the expert-data-parallel group yet; use "
                                 "--ckpt-format torch_dist")

    def _layout_problem(self, state_dict, source) -> str:
        if not isinstance(state_dict, dict) or not state_dict.get("buckets_coalesced"):
            return f"{source} is not a distributed-optimizer state in the coalesced-buckets layout"
        for buffer_index, buffer in enumerate(self.buffers):
            key = (buffer.param_dtype, buffer.grad_dtype)
            entry = state_dict.get(buffer_index, {}).get(key)
            expected = sum(b.numel_unpadded for b in buffer.buckets)
            if entry is None:
                return f"{source} has no state for buffer {buffer_index} of dtypes {key}"
            if entry.get("numel_unpadded") != expected:
                return (f"{source} buffer {buffer_index} holds {entry.get('numel_unpadded')} elements, this model "
                        f"needs {expected}: it was saved for a different model or dtype")
        return ""

    def _set_piece_state(self, piece: _ShardPiece, tensors: Dict[str, torch.Tensor]):
        main = piece.main_param
        # For fp32 params ``main`` is a view of the model param: this also writes the param buffer.
        main.data.copy_(tensors["param"])
        state = self.optimizer.state[main]
        if "exp_avg" not in state:
            self.init_state_fn(self.optimizer)
            state = self.optimizer.state[main]
        state["exp_avg"].copy_(tensors["exp_avg"])
        state["exp_avg_sq"].copy_(tensors["exp_avg_sq"])
        group_index = next(i for i, g in enumerate(self.pieces_by_group) if any(p is piece for p in g))
        step = self._loaded_steps[group_index] if self._loaded_steps is not None else 0.0
        state["step"] = torch.tensor(step, dtype=torch.float32)
