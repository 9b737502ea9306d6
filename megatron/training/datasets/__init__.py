"""Training-side data plumbing: samplers and the pretraining DataLoader."""
from megatron.training.datasets.data_samplers import (
    MegatronPretrainingRandomSampler,
    MegatronPretrainingSampler,
    build_pretraining_data_loader,
    build_pretraining_data_loader_from,
)

__all__ = [
    "MegatronPretrainingRandomSampler",
    "MegatronPretrainingSampler",
    "build_pretraining_data_loader",
    "build_pretraining_data_loader_from",
]
