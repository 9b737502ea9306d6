"""Which parameters get no weight decay: Megatron-LM's default rule, shared by training and the converter."""
from typing import Callable

import torch


def no_weight_decay_cond(apply_wd_to_qk_layernorm: bool = False) -> Callable[[str, torch.Tensor], bool]:
    """Megatron's rule as ``cond(name, param) -> bool`` (True: no weight decay for that parameter).

    1-D parameters (norm weights) and biases get no weight decay, except the q/k layernorm weights when
    ``apply_wd_to_qk_layernorm`` (``--apply-wd-to-qk-layernorm``) is set.
    """

    def no_wd(name: str, param: torch.Tensor) -> bool:
        if apply_wd_to_qk_layernorm and ("q_layernorm" in name or "k_layernorm" in name) and not name.endswith(".bias"):
            return False
        return name.endswith(".bias") or param.dim() == 1

    return no_wd
