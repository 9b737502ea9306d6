"""Test helper (not a test): pretrain_gpt.py whose model provider builds its TransformerConfig with
``MISMATCH_FIELD`` (default ``tensor_model_parallel_size``) set to ``MISMATCH_SIZE`` (default 2),
whatever the run's process groups are, for the model-build check in tests/test_process_groups_config.py.

Run like pretrain_gpt.py (same flags).
"""
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pretrain_gpt  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.training.arguments import core_transformer_config_from_args  # noqa: E402
from megatron.training.global_vars import get_args  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402
from megatron.training.user_errors import run_reporting_user_errors  # noqa: E402

FIELD = os.environ.get("MISMATCH_FIELD", "tensor_model_parallel_size")
SIZE = int(os.environ.get("MISMATCH_SIZE", "2"))


def mismatched_model_provider(pre_process=True, post_process=True, vp_stage=None):
    """A GPTModel whose config names ``FIELD`` = ``SIZE``, unlike the run's groups."""
    args = get_args()
    config = dataclasses.replace(core_transformer_config_from_args(args), **{FIELD: SIZE})
    return GPTModel(config, vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                    pre_process=pre_process, post_process=post_process)


if __name__ == "__main__":
    run_reporting_user_errors(pretrain, pretrain_gpt.train_valid_test_datasets_provider, mismatched_model_provider,
                              pretrain_gpt.forward_step)
