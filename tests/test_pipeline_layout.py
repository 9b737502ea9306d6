"""Layers per pipeline stage and their global numbers: even, uneven, account-for-embedding/loss, virtual stages."""
import pytest

from megatron.core import parallel_state as ps
from megatron.core.transformer.pipeline_layout import pipeline_layer_counts, pipeline_layer_offset
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    get_num_layers_to_build,
    get_transformer_layer_offset,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def _layers_by_stage(num_layers, pp, vp=None, **kwargs):
    """{(stage, chunk): [1-based global layer numbers]} from the count table and the offsets."""
    counts = pipeline_layer_counts(num_layers, pp, vp, **kwargs)
    return {(p, v): list(range(pipeline_layer_offset(counts, p, v) + 1,
                               pipeline_layer_offset(counts, p, v) + counts[p][v] + 1))
            for p in range(pp) for v in range(vp or 1)}


def test_megatron_interleaved_example():
    # Megatron-LM's docstring: 16 layers, pp=4, vp=2 -> GPU0 holds layers 1-2 and 9-10 (1-based).
    layout = _layers_by_stage(16, 4, 2)
    assert layout[0, 0] == [1, 2] and layout[0, 1] == [9, 10]
    assert layout[3, 0] == [7, 8] and layout[3, 1] == [15, 16]


@pytest.mark.parametrize("num_layers,pp,vp,kwargs,expected", [
    (4, 2, None, {}, [[2], [2]]),
    (3, 2, None, {"num_layers_in_first_pipeline_stage": 1}, [[1], [2]]),
    (6, 4, None, {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 1},
     [[1], [2], [2], [1]]),
    (5, 3, None, {"num_layers_in_last_pipeline_stage": 1}, [[2], [2], [1]]),
    (4, 2, None, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     [[2], [2]]),
    (6, 2, None, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     [[3], [3]]),
    (5, 2, None, {"account_for_embedding_in_pipeline_split": True}, [[2], [3]]),
    (8, 2, 2, {}, [[2, 2], [2, 2]]),
    (6, 2, 2, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True},
     [[1, 2], [2, 1]]),
    (6, 2, 2, {"num_layers_in_first_pipeline_stage": 2}, [[1, 1], [2, 2]]),
])
def test_layer_counts(num_layers, pp, vp, kwargs, expected):
    counts = pipeline_layer_counts(num_layers, pp, vp, **kwargs)
    assert counts == expected
    assert sum(map(sum, counts)) == num_layers


@pytest.mark.parametrize("num_layers,pp,vp,kwargs", [
    (16, 4, 2, {}),
    (7, 3, None, {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 2}),
    (10, 2, 2, {"account_for_embedding_in_pipeline_split": True, "account_for_loss_in_pipeline_split": True}),
    (10, 3, 2, {"num_layers_in_last_pipeline_stage": 2}),
])
def test_every_layer_is_built_exactly_once_in_model_order(num_layers, pp, vp, kwargs):
    layout = _layers_by_stage(num_layers, pp, vp, **kwargs)
    # The model runs block (stage p, chunk v) as its (v * pp + p)-th piece.
    in_model_order = [n for v in range(vp or 1) for p in range(pp) for n in layout[p, v]]
    assert in_model_order == list(range(1, num_layers + 1))


def test_megatron_offsets_with_account_for_embedding():
    # Megatron-LM: offset = pp_rank * layers_per_rank, minus 1 past the first stage (embedding counted).
    counts = pipeline_layer_counts(6, 4, account_for_embedding_in_pipeline_split=True,
                                   account_for_loss_in_pipeline_split=True)
    assert counts == [[1], [2], [2], [1]]
    assert [pipeline_layer_offset(counts, p) for p in range(4)] == [0, 1, 3, 5]


def test_config_refuses_a_split_that_virtual_stages_cannot_divide():
    with pytest.raises(ValueError, match=r"pipeline stage 0 has 1 layers, which is not divisible by "
                                         r"virtual_pipeline_model_parallel_size \(2\)"):
        TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=2,
                          virtual_pipeline_model_parallel_size=2, num_layers_in_first_pipeline_stage=1,
                          num_layers_in_last_pipeline_stage=3)


def test_transformer_block_builds_its_stage_with_global_layer_numbers():
    """Each stage's block: local module indices 0..n-1 (legacy state-dict keys), global layer_number."""
    try:
        ps.set_pipeline_model_parallel_world_size(2)
        config_kwargs = dict(num_layers=6, hidden_size=16, num_attention_heads=2, pipeline_model_parallel_size=2,
                             virtual_pipeline_model_parallel_size=2, hidden_dropout=0.0, attention_dropout=0.0,
                             account_for_embedding_in_pipeline_split=True, account_for_loss_in_pipeline_split=True)
        for rank, vp_stage, expected in ((0, 0, [1]), (1, 0, [2, 3]), (0, 1, [4, 5]), (1, 1, [6])):
            ps.set_pipeline_model_parallel_rank(rank)
            config = TransformerConfig(**config_kwargs)
            assert get_num_layers_to_build(config, vp_stage) == len(expected)
            assert get_transformer_layer_offset(config, vp_stage) == expected[0] - 1
            block = TransformerBlock(config, pre_process=(rank, vp_stage) == (0, 0),
                                     post_process=(rank, vp_stage) == (1, 1), vp_stage=vp_stage)
            assert [layer.layer_number for layer in block.layers] == expected
            names = {name.split(".")[1] for name in block.state_dict() if name.startswith("layers.")}
            assert names == {str(i) for i in range(len(expected))}
    finally:
        ps.set_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_rank(None)


def test_every_pipeline_layout_starts_from_the_same_layer_weights():
    """model_init_rng: layer n's weights depend on (seed, n) only, not on the stage that builds it or on
    what was drawn before (PP=1 builds layers 1-4 in a row; PP=2 stage 1 builds 3-4 after other draws)."""
    import torch

    from megatron.core.tensor_parallel import set_model_init_seed

    def weights(pp, rank):
        ps.set_pipeline_model_parallel_world_size(pp)
        ps.set_pipeline_model_parallel_rank(rank)
        torch.manual_seed(1234 + 100 * rank)  # the stage's own seed (dropout) must not matter
        config = TransformerConfig(num_layers=4, hidden_size=16, num_attention_heads=2,
                                   pipeline_model_parallel_size=pp)
        block = TransformerBlock(config, pre_process=rank == 0, post_process=rank == pp - 1)
        return {layer.layer_number: {k: v.clone() for k, v in layer.state_dict().items() if torch.is_tensor(v)}
                for layer in block.layers}

    try:
        set_model_init_seed(1234)
        whole = weights(1, 0)
        staged = {**weights(2, 0), **weights(2, 1)}
        assert sorted(whole) == sorted(staged) == [1, 2, 3, 4]
        for number, state in whole.items():
            for name, tensor in state.items():
                assert torch.equal(tensor, staged[number][name]), (number, name)
        assert not torch.equal(whole[1]["mlp.linear_fc1.weight"], whole[2]["mlp.linear_fc1.weight"])
    finally:
        set_model_init_seed(None)
        ps.set_pipeline_model_parallel_world_size(None)
        ps.set_pipeline_model_parallel_rank(None)
