"""Per-iteration reporting: Megatron's FLOP formula and the skipped / nan iteration counters."""
from types import SimpleNamespace

from megatron.training.training_log import LogAccumulator, num_floating_point_operations


def test_flops_formula_matches_megatrons_gpt2_small_check():
    # Spec §8.3: L12, h768, f3072, V50304, s1024, B8 -> 6,537,477,095,424 FLOPs per iteration.
    args = SimpleNamespace(seq_length=1024, num_layers=12, hidden_size=768, ffn_hidden_size=3072,
                           padded_vocab_size=50304, kv_channels=64, num_attention_heads=12,
                           group_query_attention=False, num_query_groups=1, swiglu=False)
    assert num_floating_point_operations(args, 8) == 6_537_477_095_424


def test_log_accumulator_counts_skips_and_nan_losses():
    acc = LogAccumulator()
    acc.add({"lm loss": 2.0}, 0)
    acc.add({"lm loss": 4.0}, 0)
    acc.add({"lm loss": float("inf")}, 1)  # overflow with a non-finite loss
    acc.add({"lm loss": 3.0}, 1)  # loss-scale skip with a finite loss
    assert (acc.advanced, acc.skipped, acc.nan) == (2, 2, 1)
    assert acc.losses["lm loss"] / acc.advanced == 3.0
    acc.reset()
    assert (acc.advanced, acc.skipped, acc.nan, acc.losses) == (0, 0, 0, {})
