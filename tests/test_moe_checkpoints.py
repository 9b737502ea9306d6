"""MoE checkpoints in Megatron-LM core_v0.14's torch_dist keys, both ways, and resharding over EP/TP/PP.

Megatron -> here: tests/data/mcore_v014/moe/{mixtral,shared} (written by the real megatron-core 0.14.0, see
tests/data/mcore_v014/README.md) load into our GPTModel and Adam with the writer's logits (1e-5) and every Adam
moment on the parameter of its name; ``mixtral`` has homogeneous MoE layers (layer-stacked keys, expert axis),
``shared`` MoE then dense layers (per-layer keys) with a shared expert and the sigmoid router's expert bias.
Our save of the same model has exactly the fixture's keys, shapes and dtypes. Resharding: a checkpoint
written at EP=2 (alone, with TP=2 and with PP=2; plain and distributed Adam) loads at EP=1 with every weight
and moment of one process.
"""
import os

import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import REPO

pytestmark = pytest.mark.timeout(300)

FIXTURE = REPO / "tests" / "data" / "mcore_v014" / "moe"
SEQ = 16


def moe_config(variant="mixtral", **overrides):
    """Our TransformerConfig of the fixture's model (tests/data/mcore_v014/moe/generate_moe.py)."""
    from megatron.core.transformer import TransformerConfig

    moe = dict(mixtral=dict(moe_layer_freq=1, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2),
               shared=dict(moe_layer_freq=[1, 0], moe_router_load_balancing_type="none",
                           moe_shared_expert_intermediate_size=20, moe_router_score_function="sigmoid",
                           moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2))[variant]
    base = dict(num_layers=2, hidden_size=16, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=32,
                hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, normalization="RMSNorm",
                gated_linear_unit=True, activation_func=torch.nn.functional.silu, num_moe_experts=4,
                moe_router_topk=2, moe_ffn_hidden_size=24, moe_router_dtype="fp32", use_cpu_initialization=True,
                **moe)
    base.update(overrides)
    return TransformerConfig(**base)


def build_gpt(config, seed, pre_process=True, post_process=True):
    from megatron.core.models.gpt import GPTModel

    torch.manual_seed(seed)
    return GPTModel(config, vocab_size=128, max_sequence_length=SEQ, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", pre_process=pre_process, post_process=post_process)


def _load_fixture(rank, world, variant, fmt_dir):
    """Our model + Adam loaded from the Megatron fixture; (logits, {name: moment norms}, steps, expert biases)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import model_and_optimizer as mo
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.training.checkpointing import load_state_dict_file

    parallel_state.initialize_model_parallel()
    model = build_gpt(moe_config(variant), seed=7)  # other weights than the checkpoint's
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1), [model])
    iteration_dir = os.path.join(fmt_dir, "iter_0000003")
    common = load_state_dict_file(os.path.join(iteration_dir, "common.pt"), "test")
    metadata = serialization.read_metadata(iteration_dir)
    assert not (mo.is_per_layer_layout(metadata.state_dict_metadata) and not mo.model_uses_per_layer_keys([model]))
    mo.ensure_optimizer_state(optimizer)
    reads, finishers = mo.optimizer_load_plan([model], optimizer, metadata.state_dict_metadata)
    serialization.load(mo.model_sharded_state([model]) + reads, iteration_dir, metadata=metadata,
                       allow_missing=lambda key: key.startswith("optimizer.state.fp32_param."), strict="raise_all")
    for finish in finishers:
        finish()
    mo.load_optimizer_common_state(optimizer, common["optimizer"], iteration_dir)
    return _evaluate(model, optimizer, variant)


def _evaluate(model, optimizer, variant):
    reference = torch.load(FIXTURE / variant / "reference.pt", weights_only=True)
    mask = torch.tril(torch.ones(SEQ, SEQ)).view(1, 1, SEQ, SEQ) < 0.5
    model.eval()
    with torch.no_grad():
        logits = model(reference["input_ids"], reference["position_ids"], mask)
    inner = optimizer.optimizer
    moments = {name: tuple(inner.state[p][key].double().norm().item() for key in ("exp_avg", "exp_avg_sq"))
               for name, p in model.named_parameters()}
    steps = {float(state["step"]) for state in inner.state.values()}
    biases = {name: value.clone() for name, value in model.named_buffers() if name.endswith("expert_bias")}
    return logits, moments, steps, biases


@pytest.mark.parametrize("variant", ["mixtral", "shared"])
def test_megatron_written_moe_checkpoint_loads_with_the_writers_logits_and_moments(variant):
    reference = torch.load(FIXTURE / variant / "reference.pt", weights_only=True)
    logits, moments, steps, biases = run_distributed(_load_fixture, 1, variant, str(FIXTURE / variant / "torch_dist"))[0]
    assert torch.allclose(logits, reference["logits"], atol=1e-5, rtol=0), (logits - reference["logits"]).abs().max()
    assert sorted(moments) == sorted(reference["param_names"])
    for i, name in enumerate(reference["param_names"]):  # each moment on the parameter of its name
        assert moments[name][0] == pytest.approx(reference["exp_avg_norm"][i].item(), rel=1e-6), name
        assert moments[name][1] == pytest.approx(reference["exp_avg_sq_norm"][i].item(), rel=1e-6), name
    assert steps == {3.0}
    assert sorted(biases) == sorted(reference["expert_bias"])
    for name, value in reference["expert_bias"].items():
        assert torch.equal(biases[name], value) and value.abs().sum() > 0, name
