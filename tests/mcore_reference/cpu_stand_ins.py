"""CPU stand-ins for what megatron-core 0.14 needs from CUDA, Apex or numpy 1 outside its kernels.

Imported by the reference drivers beside it (run with the real megatron-core on the path, never with
this project's ``megatron``) before they import Megatron. :func:`install` replaces, only where CUDA is
absent: ``torch.cuda.current_device`` / ``synchronize`` (its buffers and some scalars go to the current
CUDA device), ``torch.tensor(device='cuda...')`` (placed on the CPU) and ``Tensor.type()`` (the
distributed optimizer checks for a ``torch.cuda.*`` type name); and ``numpy.product`` (removed in
numpy 2, called by 0.14's distributed optimizer). :func:`patch_megatron` replaces, after Megatron is
importable, the RNG tracker's ``fork`` (dropout is 0 in these drivers),
``DistributedOptimizer._set_main_param_and_optimizer_states`` (see :func:`set_states_but_step`) and the MoE
router's undefined ``te_general_gemm`` (None).
"""
import contextlib

import numpy as np
import torch


def install() -> None:
    """Put the CUDA and numpy stand-ins in place (a no-op for CUDA where CUDA is available)."""
    if not hasattr(np, "product"):
        np.product = np.prod
    if torch.cuda.is_available():
        return
    tensor, type_name = torch.tensor, torch.Tensor.type

    def cpu_tensor(*args, device=None, **kwargs):
        return tensor(*args, device="cpu" if device is not None and "cuda" in str(device) else device, **kwargs)

    def cuda_type_name(self, *args, **kwargs):
        name = type_name(self, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs else name

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda device=None: None
    torch.tensor = cpu_tensor
    torch.Tensor.type = cuda_type_name


def set_states_but_step(self, model_param, tensors):
    """DistributedOptimizer._set_main_param_and_optimizer_states without Apex/TE: 0.14 copies every
    state entry including torch Adam's 'step', which the loaded parameter state never has (its step
    comes from the param groups), and so fails on any checkpoint; copy the others."""
    group_index, group_order = self.model_param_group_index_map[model_param]
    main_param = self.optimizer.param_groups[group_index]["params"][group_order]
    destination = {"param": main_param, **self.optimizer.state[main_param]}
    for key, tensor in tensors.items():
        destination[key].copy_(tensor)


def patch_megatron() -> None:
    """Replace the RNG tracker's fork and the optimizer-state setter of the imported megatron-core."""
    from megatron.core import tensor_parallel
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    tensor_parallel.random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    DistributedOptimizer._set_main_param_and_optimizer_states = set_states_but_step
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        # 0.14's router_gating_linear names te_general_gemm, undefined without Transformer Engine (a NameError);
        # None is what its check means: the plain matmul.
        moe_utils.te_general_gemm = None
