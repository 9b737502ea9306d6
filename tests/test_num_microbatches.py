"""Global batch -> microbatches calculator: arithmetic, errors and the singleton life cycle."""
import logging

import pytest

from megatron.core import num_microbatches_calculator as nmc


@pytest.fixture(autouse=True)
def fresh_calculator():
    nmc.destroy_num_microbatches_calculator()
    yield
    nmc.destroy_num_microbatches_calculator()


@pytest.mark.parametrize("gbs,mbs,dp", [(32, 4, 2), (8, 8, 1), (48, 2, 3)])
def test_constant_calculator(gbs, mbs, dp):
    nmc.init_num_microbatches_calculator(0, None, gbs, mbs, dp)
    assert nmc.get_num_microbatches() * mbs * dp == gbs
    assert nmc.get_current_global_batch_size() == gbs
    assert nmc.get_current_running_global_batch_size() == gbs
    assert nmc.get_micro_batch_size() == mbs
    nmc.update_num_microbatches(10 ** 6, consistency_check=True)
    assert nmc.get_num_microbatches() * mbs * dp == gbs


def test_not_divisible_message_and_decrease():
    with pytest.raises(ValueError) as info:
        nmc.init_num_microbatches_calculator(0, None, 30, 4, 2)
    assert str(info.value) == ("global batch size (30) is not divisible by micro batch size (4) times data "
                               "parallel size (2)")
    nmc.init_num_microbatches_calculator(0, None, 30, 4, 2, decrease_batch_size_if_needed=True)
    assert nmc.get_num_microbatches() == 30 // (4 * 2)
    assert nmc.get_current_running_global_batch_size() == (30 // 8) * 8
    assert nmc.get_current_global_batch_size() == 30


def test_too_small_and_invalid_sizes():
    with pytest.raises(ValueError, match="at least 1"):
        nmc.init_num_microbatches_calculator(0, None, 4, 4, 2, decrease_batch_size_if_needed=True)
    with pytest.raises(ValueError, match="micro batch size must be a positive integer"):
        nmc.init_num_microbatches_calculator(0, None, 4, 0, 1)


def test_life_cycle_errors():
    with pytest.raises(RuntimeError, match="not initialized"):
        nmc.get_num_microbatches()
    nmc.init_num_microbatches_calculator(0, None, 8, 2, 1)
    with pytest.raises(RuntimeError, match="already initialized"):
        nmc.init_num_microbatches_calculator(0, None, 8, 2, 1)
    nmc.unset_num_microbatches_calculator()
    nmc.init_num_microbatches_calculator(0, None, 16, 2, 1)
    assert nmc.get_num_microbatches() == 16 // 2


def test_rampup_is_deprecated_and_ignored(caplog):
    with caplog.at_level(logging.WARNING, logger=nmc.__name__):
        nmc.init_num_microbatches_calculator(0, [4, 4, 100], 32, 2, 2)
    assert "deprecated" in caplog.text
    assert nmc.get_num_microbatches() == 32 // (2 * 2)
    nmc.update_num_microbatches(50)
    assert nmc.get_current_global_batch_size() == 32
