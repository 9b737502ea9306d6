"""Test helper (not a test): pretrain_gpt.py whose last pipeline stage raises in its forward step of
iteration ``PP_FAIL_AT_ITERATION`` (default 3), for the pipeline failure test.

Run like pretrain_gpt.py (same flags). Before raising it prints ``injected failure at <unix time>``
so the test can measure how long every rank takes to exit after the failure.
"""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pretrain_gpt  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.training.global_vars import get_args  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402
from megatron.training.user_errors import run_reporting_user_errors  # noqa: E402

FAIL_AT_ITERATION = int(os.environ.get("PP_FAIL_AT_ITERATION", "3"))


def failing_forward_step(data_iterator, model):
    """``pretrain_gpt.forward_step``, except on the last stage in iteration ``FAIL_AT_ITERATION``."""
    if parallel_state.is_pipeline_last_stage() and get_args().curr_iteration + 1 == FAIL_AT_ITERATION:
        print(f"injected failure at {time.time():.3f}", flush=True)
        raise RuntimeError(f"injected failure in iteration {FAIL_AT_ITERATION}")
    return pretrain_gpt.forward_step(data_iterator, model)


if __name__ == "__main__":
    run_reporting_user_errors(pretrain, pretrain_gpt.train_valid_test_datasets_provider, pretrain_gpt.model_provider,
                              failing_forward_step)
