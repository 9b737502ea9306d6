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


# ---------------------------------------------------------------------------------------------------
# --rampup-batch-size (values computed by hand from Megatron-LM's rule:
# batch = start + increment * int(consumed / (ramp_samples / ((global - start) / increment))))
# ---------------------------------------------------------------------------------------------------

def test_rampup_schedule_by_hand(caplog):
    # start 16, increment 8, global 32 over 100 samples: 2 increments, one every 50 samples.
    with caplog.at_level(logging.INFO, logger=nmc.__name__):
        nmc.init_num_microbatches_calculator(0, ["16", "8", "100"], 32, 2, 2)
    assert "will use batch size rampup starting from global batch size 16 to global batch size 32" in caplog.text
    assert "setting initial batch size to 16" in caplog.text
    expected = {0: (16, 4), 49: (16, 4), 50: (24, 6), 99: (24, 6), 100: (32, 8), 101: (32, 8), 10 ** 6: (32, 8)}
    for consumed, (batch, microbatches) in expected.items():
        nmc.update_num_microbatches(consumed, consistency_check=True)
        assert (nmc.get_current_global_batch_size(), nmc.get_num_microbatches()) == (batch, microbatches), consumed
        assert nmc.get_current_running_global_batch_size() == batch
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=nmc.__name__):
        nmc.update_num_microbatches(0, verbose=True)
        nmc.update_num_microbatches(60, verbose=True)
        nmc.update_num_microbatches(70, verbose=True)
    assert caplog.text.count("ramping up batch size from 16 to 24") == 1


def test_rampup_as_a_training_loop_sees_it():
    # The batch of an iteration depends on the samples consumed before it.
    nmc.init_num_microbatches_calculator(0, [16, 8, 100], 32, 2, 2)
    consumed, batches = 0, []
    for _ in range(9):
        nmc.update_num_microbatches(consumed)
        batches.append(nmc.get_current_running_global_batch_size())
        consumed += nmc.get_num_microbatches() * 2 * 2
    assert batches == [16, 16, 16, 16, 24, 24, 32, 32, 32]
    assert consumed == 16 * 4 + 24 * 2 + 32 * 3


def test_rampup_uneven_increment_spacing():
    # 2 increments over 10 samples -> one every 5.0 samples; float arithmetic as in Megatron-LM.
    nmc.init_num_microbatches_calculator(0, [4, 4, 10], 12, 1, 2)
    got = []
    for consumed in (0, 4, 5, 8, 9, 10, 11):
        nmc.update_num_microbatches(consumed)
        got.append(nmc.get_current_global_batch_size())
    assert got == [4, 4, 8, 8, 8, 12, 12]


def test_rampup_with_nothing_to_ramp_is_constant():
    nmc.init_num_microbatches_calculator(0, [8, 4, 100], 8, 2, 2)
    for consumed in (0, 50, 500):
        nmc.update_num_microbatches(consumed)
        assert nmc.get_num_microbatches() == 2


def test_rampup_with_decrease_batch_size_if_needed():
    # mbs 2 x dp 3 = 6: 8 -> 6, 12 -> 12, 16 -> 12, 20 -> 18 samples actually consumed.
    calc = nmc.RampupBatchsizeNumMicroBatchesCalculator(20, 2, 3, True, 0, 8, 4, 30)
    running = []
    for consumed in (0, 10, 20, 31):
        calc.update(consumed, consistency_check=True)
        running.append((calc.get_current_global_batch_size(), calc.get_current_running_global_batch_size(),
                        calc.get()))
    assert running == [(8, 6, 1), (12, 12, 2), (16, 12, 2), (20, 18, 3)]


@pytest.mark.parametrize("rampup,gbs,mbs,dp,message", [
    (["16", "8"], 32, 2, 2, r"expected --rampup-batch-size <start batch size> <batch size increment> <ramp-up "
                            r"samples>, got 2 value\(s\)"),
    (["16", "8", "1e3"], 32, 2, 2, "as integers"),
    ([0, 8, 100], 32, 2, 2, "--rampup-batch-size start batch size must be a positive integer, got 0"),
    ([16, 0, 100], 32, 2, 2, "--rampup-batch-size batch size increment must be a positive integer"),
    ([16, 8, -1], 32, 2, 2, "ramp-up samples must be a non-negative integer, got -1"),
    ([48, 8, 100], 32, 2, 2, r"start batch size \(48\) must not exceed the global batch size \(32"),
    ([16, 6, 100], 32, 2, 2, r"difference .* \(32\) and the start batch size \(16\) is 16, not a multiple of "
                             r"the increment \(6\)"),
    ([16, 2, 100], 32, 2, 2, r"--rampup-batch-size: global batch size \(18\) is not divisible by micro batch "
                             r"size \(2\) times data parallel size \(2\)"),
    ([2, 2, 100], 8, 2, 2, r"--rampup-batch-size: global batch size \(2\) is not divisible"),
])
def test_rampup_errors_name_the_flag(rampup, gbs, mbs, dp, message):
    with pytest.raises(ValueError, match=message):
        nmc.init_num_microbatches_calculator(0, rampup, gbs, mbs, dp)


def test_rampup_batch_below_one_microbatch_per_rank_fails_even_when_rounding():
    with pytest.raises(ValueError, match="number of microbatches should be at least 1"):
        nmc.init_num_microbatches_calculator(0, [2, 2, 100], 8, 2, 2, decrease_batch_size_if_needed=True)


def test_reconfigure_replaces_the_calculator():
    nmc.init_num_microbatches_calculator(0, None, 8, 2, 1)
    nmc.reconfigure_num_microbatches_calculator(0, [2, 2, 4], 6, 2, 1)
    assert nmc.get_num_microbatches() == 1
    nmc.update_num_microbatches(100)
    assert nmc.get_num_microbatches() == 3
