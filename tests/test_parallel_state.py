"""parallel_state: Megatron rank layout, group counts at 8 and 512 ranks (fake backend), real gloo groups."""
import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from dist_utils import run_distributed
from megatron.core import parallel_state as ps
from megatron.core.parallel_state import RankGenerator, generate_masked_orthogonal_rank_groups

# The verified Megatron-LM table for world=16, tp=2, cp=2, dp=2, pp=2 (spec section 3.1).
VERIFIED_16 = {
    "tp": [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
    "cp": [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
    "dp": [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]],
    "dp-cp": [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
    "pp": [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
    "tp-pp": [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]],
    "tp-cp": [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]],
    "tp-dp-cp": [list(range(8)), list(range(8, 16))],
}


@pytest.mark.parametrize("token", sorted(VERIFIED_16))
def test_verified_layout_world16(token):
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks(token) == VERIFIED_16[token]


def _coords(rank, tp, cp, dp):
    return rank % tp, (rank // tp) % cp, (rank // (tp * cp)) % dp, rank // (tp * cp * dp)


@pytest.mark.parametrize("tp,cp,dp,pp", [(2, 1, 3, 2), (4, 1, 1, 2), (1, 2, 2, 3), (2, 2, 2, 1)])
def test_groups_partition_world_and_vary_only_masked_axes(tp, cp, dp, pp):
    world = tp * cp * dp * pp
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    axes = {"tp": 0, "cp": 1, "dp": 2, "pp": 3}
    for token in ("tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-dp-cp"):
        groups = gen.get_ranks(token)
        assert sorted(r for g in groups for r in g) == list(range(world))
        fixed = [a for name, a in axes.items() if name not in token.split("-")]
        for group in groups:
            keys = {tuple(_coords(r, tp, cp, dp)[a] for a in fixed) for r in group}
            assert len(keys) == 1, f"{token} group {group} mixes fixed coordinates"
            assert group == sorted(group)


def test_tp_pp_dp_order_puts_dp_slowest():
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=2, cp=1, order="tp-cp-ep-pp-dp")
    assert gen.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert gen.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_missing_axis_in_order_raises():
    with pytest.raises(RuntimeError, match=r"The size of \(pp\) is \(2\), but you haven't specified the order"):
        RankGenerator(tp=2, ep=1, dp=1, pp=2, cp=1, order="tp-dp")


def test_masked_generator_rejects_bad_world():
    with pytest.raises(ValueError, match="world_size"):
        generate_masked_orthogonal_rank_groups(8, [2, 2], [True, False])


def test_getters_without_groups_are_single_process():
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_data_parallel_world_size() == 1
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    assert not ps.model_parallel_is_initialized()
    with pytest.raises(AssertionError, match="tensor model parallel group is not initialized"):
        ps.get_tensor_model_parallel_group()


def _ranks(group):
    return dist.get_process_group_ranks(group)


def _two_ranks(rank, world):
    out = {}
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    out["tp"] = _ranks(ps.get_tensor_model_parallel_group())
    out["tp_rank"] = ps.get_tensor_model_parallel_rank()
    out["dp"] = _ranks(ps.get_data_parallel_group())
    out["dp_gloo"] = _ranks(ps.get_data_parallel_group_gloo())
    out["pp_world"] = ps.get_pipeline_model_parallel_world_size()
    out["src"] = ps.get_tensor_model_parallel_src_rank()
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=2)
    except AssertionError as exc:
        out["double"] = str(exc)
    ps.destroy_model_parallel()

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    out["first"] = ps.is_pipeline_first_stage()
    out["last"] = ps.is_pipeline_last_stage()
    ps.set_virtual_pipeline_model_parallel_rank(1)
    out["first_virtual"] = ps.is_pipeline_first_stage(ignore_virtual=False)
    out["next"], out["prev"] = ps.get_pipeline_model_parallel_next_rank(), ps.get_pipeline_model_parallel_prev_rank()
    out["emb"] = _ranks(ps.get_embedding_group())
    out["pos_emb"] = _ranks(ps.get_position_embedding_group())
    out["in_pos"] = ps.is_rank_in_position_embedding_group()
    ps.destroy_model_parallel()

    errors = []
    for kwargs in ({"tensor_model_parallel_size": 3}, {"virtual_pipeline_model_parallel_size": 2}):
        try:
            ps.initialize_model_parallel(**kwargs)
        except RuntimeError as exc:
            errors.append(str(exc))
        ps.destroy_model_parallel()
    out["errors"] = errors
    return out


def test_two_process_groups():
    r0, r1 = run_distributed(_two_ranks, 2)
    assert r0["tp"] == r1["tp"] == [0, 1]
    assert (r0["tp_rank"], r1["tp_rank"]) == (0, 1)
    assert r0["dp"] == [0] and r1["dp"] == [1] and r1["dp_gloo"] == [1]
    assert r0["pp_world"] == 1 and r0["src"] == r1["src"] == 0
    assert "already initialized" in r0["double"]
    assert (r0["first"], r0["last"], r1["first"], r1["last"]) == (True, False, False, True)
    assert r0["first_virtual"] is False
    assert (r0["next"], r0["prev"], r1["next"], r1["prev"]) == (1, 1, 0, 0)
    assert r0["emb"] == [0, 1] and r0["pos_emb"] == [0]
    assert r0["in_pos"] and not r1["in_pos"]
    assert "world_size (2) is not divisible by 3" in r0["errors"][0]
    assert "pipeline-model-parallel size should be greater than 1 with interleaved schedule" in r0["errors"][1]


def _four_ranks(rank, world):
    names = {
        "tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
        "dp": ps.get_data_parallel_group, "cp": ps.get_context_parallel_group,
        "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
        "tp-pp": ps.get_model_parallel_group,
        "tp-dp-cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
        "tp-cp": ps.get_tensor_and_context_parallel_group,
    }
    out = {}
    for label, kwargs in (("tp2pp2", dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)),
                          ("cp2", dict(context_parallel_size=2))):
        ps.initialize_model_parallel(**kwargs)
        out[label] = {name: _ranks(get()) for name, get in names.items()}
        out[label]["dp_world"] = ps.get_data_parallel_world_size()
        out[label]["dp_cp_world"] = ps.get_data_parallel_world_size(with_context_parallel=True)
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(pipeline_model_parallel_size=4)
    group = ps.get_embedding_group()
    out["pp4_embedding"] = None if group is None else _ranks(group)
    out["pp4_in_embedding"] = ps.is_rank_in_embedding_group()
    if group is not None:
        value = torch.tensor([float(rank + 1)])
        dist.all_reduce(value, group=group)
        out["pp4_embedding_sum"] = value.item()
    ps.destroy_model_parallel()
    return out


def test_four_process_groups_match_generator():
    results = run_distributed(_four_ranks, 4)
    for label, (tp, cp, dp, pp) in (("tp2pp2", (2, 1, 1, 2)), ("cp2", (1, 2, 2, 1))):
        gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
        for rank, result in enumerate(results):
            for token in ("tp", "pp", "dp", "cp", "dp-cp", "tp-pp", "tp-dp-cp", "tp-cp"):
                expected = next(g for g in gen.get_ranks(token) if rank in g)
                assert result[label][token] == expected, (label, rank, token)
            assert result[label]["dp_world"] == dp
            assert result[label]["dp_cp_world"] == dp * cp
    # PP=4: the middle stages hold no embedding and get no embedding group.
    assert [r["pp4_embedding"] for r in results] == [[0, 3], None, None, [0, 3]]
    assert [r["pp4_in_embedding"] for r in results] == [True, False, False, True]
    assert results[0]["pp4_embedding_sum"] == results[3]["pp4_embedding_sum"] == 1.0 + 4.0


# ----------------------------------------------------------------------------------------------
# Group counts and rank lists at 8 and 512 ranks, in this process, with the fake backend
# ----------------------------------------------------------------------------------------------
# getter -> (generator, token): the rank list every getter must still return (Megatron's layout).
_DENSE_GETTERS = {
    "tp": ps.get_tensor_model_parallel_group, "pp": ps.get_pipeline_model_parallel_group,
    "dp": ps.get_data_parallel_group, "cp": ps.get_context_parallel_group,
    "dp-cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "tp-pp": ps.get_model_parallel_group,
    "tp-dp": ps.get_tensor_and_data_parallel_group,
    "tp-dp-cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "tp-cp": ps.get_tensor_and_context_parallel_group,
    "dp-gloo": ps.get_data_parallel_group_gloo,
    "dp-cp-gloo": lambda: ps.get_data_parallel_group_gloo(with_context_parallel=True),
    "dp-cp-partial": lambda: ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True),
}
_EXPERT_GETTERS = {
    "ep": ps.get_expert_model_parallel_group, "tp": ps.get_expert_tensor_parallel_group,
    "tp-ep": ps.get_expert_tensor_and_model_parallel_group,
    "tp-ep-pp": ps.get_expert_tensor_model_pipeline_parallel_group,
    "dp": ps.get_expert_data_parallel_group, "dp-gloo": ps.get_expert_data_parallel_group_gloo,
}


def _build_fake(world, rank, **kwargs):
    """initialize_model_parallel as ``rank`` of ``world`` on the fake backend.

    Returns (globally synchronised new_group rank lists in call order, local new_group rank lists,
    the distinct groups the getters hand out).
    """
    calls, local_calls = [], []
    real_new_group = dist.new_group

    def counting_new_group(ranks=None, *args, **kw):
        (local_calls if kw.get("use_local_synchronization") else calls).append(sorted(ranks))
        return real_new_group(ranks, *args, **kw)

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    dist.new_group = counting_new_group
    try:
        ps.initialize_model_parallel(**kwargs)
    finally:
        dist.new_group = real_new_group
    getters = list(_DENSE_GETTERS.values()) + list(_EXPERT_GETTERS.values())
    getters += [ps.get_embedding_group, ps.get_position_embedding_group]
    handed_out = {id(group): group for group in (get() for get in getters) if group is not None}
    return calls, local_calls, list(handed_out.values())


def _teardown_fake():
    ps.destroy_model_parallel()
    dist.destroy_process_group()


# (world, kwargs, new groups per rank, distinct groups rank 3 is handed). Before this change the same
# layouts created 93, 72, 64 (world 8) and 5637, 2970, 1800 (world 512) groups on every rank.
#   plain DP / TP=world: every list is the world or one rank -> only this rank's own group.
#   2x2x2 at 8: tp 4 + dp 4 + pp 4 (= embedding) + tp-pp 2 + tp-dp 2 lists, + own group = 17.
#   8x4x16 at 512: tp 64 + dp 32 + pp 128 + embedding 128 + tp-pp 16 + tp-dp 4, + own group = 373.
_COUNTS = [
    (8, {}, 1, 2),
    (8, dict(tensor_model_parallel_size=8), 1, 2),
    (8, dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 17, 6),
    (512, {}, 1, 2),
    (512, dict(tensor_model_parallel_size=8), 73, 4),
    (512, dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=4), 373, 7),
]


@pytest.mark.parametrize("world,kwargs,new_groups,distinct", _COUNTS)
def test_group_count_fake_backend(world, kwargs, new_groups, distinct):
    calls, local_calls, handed_out = _build_fake(world, 3, **kwargs)
    try:
        assert len(calls) + len(local_calls) == new_groups
        assert local_calls == [[3]], "one-member groups: a single local group of this rank"
        assert len({tuple(c) for c in calls}) == len(calls), "a rank set was created twice"
        assert all(1 < len(c) < world for c in calls)
        assert len(handed_out) == distinct
        if new_groups == 1:
            assert dist.group.WORLD in handed_out
    finally:
        _teardown_fake()


def test_global_group_creation_order_is_the_same_on_every_rank():
    kwargs = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    sequences = []
    for rank in (0, 5, 17, 63):
        calls, _, _ = _build_fake(64, rank, **kwargs)
        _teardown_fake()
        sequences.append(calls)
    assert sequences[0] and all(seq == sequences[0] for seq in sequences)


@pytest.mark.parametrize("world,tp,pp,cp,ranks", [
    (8, 2, 2, 1, (0, 3, 6, 7)),
    (8, 1, 1, 2, (0, 5)),
    (512, 8, 4, 1, (0, 1, 9, 100, 255, 511)),
    (512, 4, 2, 2, (0, 77, 300, 511)),
])
def test_getters_keep_megatron_rank_lists(world, tp, pp, cp, ranks):
    dp = world // (tp * pp * cp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    expert_gen = RankGenerator(tp=tp, ep=1, dp=dp * cp, pp=pp, cp=1, order="tp-cp-ep-dp-pp")
    for rank in ranks:
        _build_fake(world, rank, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                    context_parallel_size=cp)
        try:
            for label, get in _DENSE_GETTERS.items():
                token = label.replace("-gloo", "").replace("-partial", "")
                expected = next(g for g in gen.get_ranks(token) if rank in g)
                assert _ranks(get()) == expected, (rank, label)
            for label, get in _EXPERT_GETTERS.items():
                token = label.replace("-gloo", "")
                expected = next(g for g in expert_gen.get_ranks(token) if rank in g)
                assert _ranks(get()) == expected, (rank, "expert " + label)
            pp_ranks = next(g for g in gen.get_ranks("pp") if rank in g)
            assert ps.get_pipeline_model_parallel_first_rank() == pp_ranks[0]
            assert ps.get_pipeline_model_parallel_last_rank() == pp_ranks[-1]
            assert ps.get_tensor_model_parallel_src_rank() == next(g for g in gen.get_ranks("tp") if rank in g)[0]
            assert ps.get_tensor_model_parallel_world_size() == tp
            assert ps.get_data_parallel_world_size() == dp
            assert ps.get_context_parallel_world_size() == cp
            assert ps.get_expert_model_parallel_world_size() == 1
        finally:
            _teardown_fake()


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_middle_stage_is_outside_the_embedding_groups(rank):
    _build_fake(3, rank, pipeline_model_parallel_size=3)
    try:
        in_embedding = rank in (0, 2)
        assert ps.is_rank_in_embedding_group() is in_embedding
        assert ps.is_rank_in_position_embedding_group() is (rank == 0)
        if in_embedding:
            assert _ranks(ps.get_embedding_group()) == [0, 2]
        else:
            assert ps.get_embedding_group() is None
        if rank == 0:
            assert _ranks(ps.get_position_embedding_group()) == [0]
        else:
            assert ps.get_position_embedding_group() is None
    finally:
        _teardown_fake()


# ----------------------------------------------------------------------------------------------
# Pipeline parallelism: Megatron's PP groups at 64 ranks, embedding-group membership at PP=3
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("rank", [0, 1, 2, 17, 30, 33, 47, 48, 63])
def test_pipeline_groups_world64_tp2_pp4_dp8_follow_megatron_layout(rank):
    """Spec 3.1, order tp-cp-ep-dp-pp: global rank = tp_r + 2 * (dp_r + 8 * pp_r), so one pipeline is
    {tp_r + 2 * dp_r + 16 * p : p = 0..3}; its first and last ranks hold the (tied) embedding."""
    tp, dp, pp = 2, 8, 4
    _build_fake(64, rank, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    try:
        tp_r, dp_r, pp_r = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        pipeline = [tp_r + tp * dp_r + tp * dp * p for p in range(pp)]
        assert _ranks(ps.get_pipeline_model_parallel_group()) == pipeline
        assert ps.get_pipeline_model_parallel_world_size() == pp
        assert ps.get_pipeline_model_parallel_rank() == pp_r
        assert ps.get_pipeline_model_parallel_first_rank() == pipeline[0]
        assert ps.get_pipeline_model_parallel_last_rank() == pipeline[-1]
        assert ps.get_pipeline_model_parallel_next_rank() == pipeline[(pp_r + 1) % pp]
        assert ps.get_pipeline_model_parallel_prev_rank() == pipeline[(pp_r - 1) % pp]
        assert ps.is_pipeline_first_stage() is (pp_r == 0)
        assert ps.is_pipeline_last_stage() is (pp_r == pp - 1)
        assert _ranks(ps.get_model_parallel_group()) == sorted(
            t + tp * dp_r + tp * dp * p for t in range(tp) for p in range(pp))
        assert _ranks(ps.get_data_parallel_group()) == [tp_r + tp * d + tp * dp * pp_r for d in range(dp)]
        holds_embedding = pp_r in (0, pp - 1)
        assert ps.is_rank_in_embedding_group() is holds_embedding
        group = ps.get_embedding_group()
        assert (None if group is None else _ranks(group)) == ([pipeline[0], pipeline[-1]] if holds_embedding else None)
        group = ps.get_position_embedding_group()
        assert (None if group is None else _ranks(group)) == ([pipeline[0]] if pp_r == 0 else None)
    finally:
        _teardown_fake()


def _pp3_embedding_groups(rank, world):
    ps.initialize_model_parallel(pipeline_model_parallel_size=3)
    out = {"in": ps.is_rank_in_embedding_group(), "in_pos": ps.is_rank_in_position_embedding_group()}
    for key, group in (("emb", ps.get_embedding_group()), ("pos", ps.get_position_embedding_group())):
        out[key] = None if group is None else _ranks(group)
        if group is not None:  # a real collective: only members take part, so a wrong group would hang or mis-sum
            value = torch.tensor([float(10 ** rank)])
            dist.all_reduce(value, group=group)
            out[key + "_sum"] = value.item()
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_pp3_every_rank_is_handed_only_embedding_groups_it_belongs_to():
    results = run_distributed(_pp3_embedding_groups, 3, timeout=150)
    assert [r["emb"] for r in results] == [[0, 2], None, [0, 2]]
    assert [r["in"] for r in results] == [True, False, True]
    assert results[0]["emb_sum"] == results[2]["emb_sum"] == 1.0 + 100.0
    assert [r["pos"] for r in results] == [[0], None, None]
    assert [r["in_pos"] for r in results] == [True, False, False]
    assert results[0]["pos_sum"] == 1.0
