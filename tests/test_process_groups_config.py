"""ModelCommProcessGroups and the model-build check: a GPTModel whose config's tensor- or pipeline-parallel
size differs from its process groups' is refused at build with one line naming both sizes (issue 29 item 3)."""
import os

import pytest
import torch.distributed as dist

from dist_utils import run_distributed
from pretrain_utils import REPO, run_ranks
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.process_groups_config import (
    ModelCommProcessGroups,
    ParallelConfigMismatchError,
    check_parallel_config,
)
from megatron.core.transformer import TransformerConfig

V, S = 32, 8
FIX = "build the model after initializing model parallel with the same size"


def _config(**kw):
    return TransformerConfig(**dict(dict(num_layers=2, hidden_size=16, num_attention_heads=4,
                                         use_cpu_initialization=True), **kw))


def _build(config, **kw):
    return GPTModel(config, vocab_size=V, max_sequence_length=S, **kw)


@pytest.fixture
def _overrides_cleared():
    yield
    ps.set_tensor_model_parallel_world_size(None)
    ps.set_pipeline_model_parallel_world_size(None)


def test_tp2_config_in_a_tp1_world_fails_at_build_naming_both_sizes():
    with pytest.raises(ParallelConfigMismatchError) as caught:
        _build(_config(tensor_model_parallel_size=2))
    message = str(caught.value)
    assert message == ("TransformerConfig.tensor_model_parallel_size=2 but the tensor-parallel group has 1 rank(s): "
                       + FIX)
    assert isinstance(caught.value, ValueError)


def test_pp2_config_in_a_pp1_world_fails_at_build_naming_both_sizes():
    with pytest.raises(ParallelConfigMismatchError) as caught:
        _build(_config(pipeline_model_parallel_size=2))
    assert str(caught.value) == ("TransformerConfig.pipeline_model_parallel_size=2 but the pipeline-parallel group "
                                 "has 1 rank(s): " + FIX)


def test_cp2_config_in_a_cp1_world_fails_at_build_naming_both_sizes():
    with pytest.raises(ParallelConfigMismatchError) as caught:
        _build(_config(context_parallel_size=2))
    assert str(caught.value) == ("TransformerConfig.context_parallel_size=2 but the context-parallel group "
                                 "has 1 rank(s): " + FIX)


def test_matching_config_builds_with_default_and_explicit_groups():
    model = _build(_config())
    assert isinstance(model.model_comm_pgs, ModelCommProcessGroups)
    assert model.model_comm_pgs.tp is None  # a single process without groups: every size is 1
    _build(_config(), model_comm_pgs=ModelCommProcessGroups.use_mpu_process_groups(required_pgs=["tp", "pp"]))
    with pytest.raises(ParallelConfigMismatchError, match="tensor_model_parallel_size=2"):
        _build(_config(tensor_model_parallel_size=2), model_comm_pgs=ModelCommProcessGroups())


def test_sizes_set_on_parallel_state_count_as_the_layers_see_them(_overrides_cleared):
    """A converter builds a model for a rank it is not (``set_*_world_size``): the layers shard for that
    size, so a config naming it builds and one naming the process's real size does not."""
    ps.set_tensor_model_parallel_world_size(2)
    assert _build(_config(tensor_model_parallel_size=2)).decoder.layers[0].self_attention.linear_qkv.weight.shape[0] \
        == 3 * 16 // 2
    with pytest.raises(ParallelConfigMismatchError, match="tensor_model_parallel_size=1 but the tensor-parallel group "
                                                          r"has 2 rank\(s\)"):
        _build(_config())
    ps.set_pipeline_model_parallel_world_size(2)
    check_parallel_config(_config(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
                          ModelCommProcessGroups.use_mpu_process_groups())


def test_unknown_group_name_is_refused():
    with pytest.raises(ValueError, match=r"unknown process group\(s\) \['dp'\]; valid choices: tp, pp, "):
        ModelCommProcessGroups.use_mpu_process_groups(required_pgs=["tp", "dp"])


def _groups_on_tp2(rank, world):
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        pgs = ModelCommProcessGroups.use_mpu_process_groups()
        only = ModelCommProcessGroups.use_mpu_process_groups(required_pgs=["tp"])
        sizes = {name: dist.get_world_size(group=getattr(pgs, name))
                 for name in ("tp", "pp", "mp", "embd", "pos_embd", "cp", "tp_cp", "ep", "expt_tp", "tp_ep",
                              "tp_ep_pp", "expt_dp")}
        model = _build(_config(tensor_model_parallel_size=2))
        try:
            _build(_config())
            refused = None
        except ParallelConfigMismatchError as error:
            refused = str(error)
        return dict(sizes=sizes, same_tp=pgs.tp is ps.get_tensor_model_parallel_group(), only_tp=only.pp is None,
                    model_tp=model.model_comm_pgs.tp is ps.get_tensor_model_parallel_group(), refused=refused)
    finally:
        ps.destroy_model_parallel()


def test_use_mpu_process_groups_on_two_gloo_ranks_with_tp2():
    for rank, result in enumerate(run_distributed(_groups_on_tp2, 2)):
        assert result["sizes"] == dict(tp=2, pp=1, mp=2, embd=1, pos_embd=1, cp=1, tp_cp=2, ep=1, expt_tp=2, tp_ep=2,
                                       tp_ep_pp=2, expt_dp=1), rank
        assert result["same_tp"] and result["only_tp"] and result["model_tp"], rank
        assert result["refused"] == ("TransformerConfig.tensor_model_parallel_size=1 but the tensor-parallel group "
                                     "has 2 rank(s): " + FIX), rank


MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
         "--distributed-backend", "gloo", "--micro-batch-size", "2", "--global-batch-size", "2", "--lr", "1e-3",
         "--mock-data", "--eval-iters", "0", "--train-iters", "1", "--num-workers", "0"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("field,label", [("tensor_model_parallel_size", "tensor-parallel"),
                                         ("pipeline_model_parallel_size", "pipeline-parallel")])
def test_pretrain_with_a_mismatched_model_provider_ends_with_one_error_line(field, label):
    result = run_ranks(1, [REPO / "tests" / "mismatched_parallel_pretrain.py", *MODEL],
                       env=dict(os.environ, MISMATCH_FIELD=field, MISMATCH_SIZE="2"))
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if "error: " in line]
    assert lines == [f"error: TransformerConfig.{field}=2 but the {label} group has 1 rank(s): {FIX}"], out[-3000:]
