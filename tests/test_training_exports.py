"""Megatron-LM's `from megatron.training import ...` names resolve to the project's functions."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_megatron_public_training_names_import_in_a_fresh_interpreter():
    # A fresh interpreter: the names must work without any submodule having been imported first.
    code = (
        "from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0, "
        "print_rank_last, is_last_rank, get_tensorboard_writer, get_wandb_writer, initialize_megatron, "
        "get_model, get_train_valid_test_num_samples\n"
        "import megatron.training.training as t, megatron.training.global_vars as g, megatron.training.utils as u\n"
        "assert pretrain is t.pretrain and get_model is t.get_model\n"
        "assert get_args is g.get_args and get_timers is g.get_timers and get_tokenizer is g.get_tokenizer\n"
        "assert print_rank_0 is u.print_rank_0 and is_last_rank is u.is_last_rank\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_unknown_name_is_an_attribute_error():
    import megatron.training

    with pytest.raises(AttributeError, match="no attribute 'get_one_logger'"):
        megatron.training.get_one_logger  # noqa: B018
    assert "pretrain" in dir(megatron.training)
