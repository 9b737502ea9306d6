"""Fake-process-group simulation of a 7B GPT rank at DP=8, 64, 512: the optimizer bytes measured from the
real DDP buffers and (distributed) optimizer on meta tensors equal Megatron's formula (12 bytes/param, over
DP with the distributed optimizer) within the buckets' padding."""
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from bench_memory_report import llama2_7b_args, main, simulate_rank  # noqa: E402
from megatron.training.theoretical_memory_usage import compute_weight_and_optimizer_memory  # noqa: E402

LLAMA2_7B_PARAMS = 6_738_415_616


@pytest.mark.parametrize("dp", [8, 64, 512])
@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "distopt"])
def test_7b_optimizer_bytes_per_rank(dp, distributed):
    args = llama2_7b_args(dp, distributed)
    # The last rank holds the last shard, where the padding of a bucket ends up.
    results = [simulate_rank(args, rank) for rank in (0, dp - 1)]
    for result in results:
        assert result["dp"] == dp
        assert result["params"] == LLAMA2_7B_PARAMS
        expected = 12 * LLAMA2_7B_PARAMS / (dp if distributed else 1)
        assert result["formula"] == pytest.approx(expected, rel=1e-12)
        if distributed:
            # A shard may hold up to its share of padding less (or, at most, the whole padding more).
            assert abs(result["measured"] - expected) <= result["padding"]
            # The padding itself is small: under lcm(dp, 128) per bucket end plus 64 per param start.
            assert result["padding"] <= 12 * (result["buckets"] * math.lcm(dp, 128) + 64 * result["tensors"])
            assert result["measured"] / expected == pytest.approx(1.0, abs=1e-3)
        else:
            assert result["measured"] == expected
    footprint = compute_weight_and_optimizer_memory(args)
    megatron_bytes_per_param = 6 + 12 / dp if distributed else 18
    assert footprint.weight_and_optimizer_bytes / LLAMA2_7B_PARAMS == pytest.approx(megatron_bytes_per_param)


def test_simulation_prints_the_table(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_memory_report.py", "--dp", "8"])
    main()
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("8 ")]
    assert [row[1] for row in rows] == ["False", "True"]
    assert [float(row[-1]) for row in rows] == [18.0, 7.5]
    assert float(rows[0][-2]) == 1.0 and float(rows[1][-2]) == pytest.approx(1.0, abs=1e-3)
    assert out.count("Theoretical memory footprints: weight and optimizer=") == 2


@pytest.mark.parametrize("dp", [3, 6])
def test_odd_shapes_shards_cover_every_parameter_once(dp):
    """Sizes that are not multiples of 64 and small buckets: padding appears, the shards of all ranks
    still hold exactly 12 bytes per parameter together, and each rank is within the padding of 12 N / DP."""
    args = llama2_7b_args(dp, True, num_layers=2, hidden_size=72, num_attention_heads=3, kv_channels=24,
                          num_query_groups=3, ffn_hidden_size=200, padded_vocab_size=1000,
                          max_position_embeddings=64, ddp_bucket_size=6000)
    results = [simulate_rank(args, rank) for rank in range(dp)]
    n = results[0]["params"]
    assert results[0]["buckets"] > 1 and results[0]["padding"] > 0
    assert sum(r["measured"] for r in results) == 12 * n
    for r in results:
        assert abs(r["measured"] - 12 * n / dp) <= r["padding"]
