"""MoE in the throughput FLOPs (active parameters, Megatron core_v0.14's formula) and in the theoretical memory
report (every expert, 1/EP of them per rank, experts' optimizer state over expert-DP), against numbers worked
out by hand for one small config."""
import dataclasses

import pytest

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import parse_args, validate_args
from megatron.training.theoretical_memory_usage import (
    activation_memory_per_layer,
    bytes_per_parameter,
    compute_activation_memory,
    compute_weight_and_optimizer_memory,
    expert_data_parallel_size,
    gpt_parameter_shapes,
    model_memory_refusal,
    num_expert_parameters_on_rank,
    num_parameters_in_model,
    num_parameters_on_rank,
)
from megatron.training.training_log import gpt_floating_point_operations

# h 64, ffn 128, 4 heads of 16 channels, 2 query groups, SwiGLU, RMSNorm, untied, vocabulary 1024.
FLAGS = ["--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
         "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10",
         "--lr", "1e-3", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
         "--disable-bias-linear", "--bf16", "--use-distributed-optimizer"]
# 4 experts of ffn 32, top-2, a shared expert of 48, MoE at layers 1 and 3 (moe_layer_freq 2).
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=48,
           moe_layer_freq=2)


def _config(monkeypatch, ep=1, world=2, **model):
    """A run's config container (world ranks, DP = world) with the MoE settings put on its TransformerConfig."""
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    args = validate_args(parse_args(args=FLAGS))
    args.padded_vocab_size = 1024
    cfg = pretrain_cfg_container_from_args(args, with_telemetry=False)
    cfg.model = dataclasses.replace(cfg.model, expert_model_parallel_size=ep, **{**MOE, **model})
    return cfg


def test_flops_count_the_active_experts():
    # Per token: attention 6*L*(h*(q+2kv) + q*h) = 6*4*(64*128 + 64*64) = 294,912; MLP 6*h*3*(f*L_dense +
    # (F*topk + F_shared)*L_moe) = 1152*(128*2 + (32*2 + 48)*2) = 552,960; logits 6*64*1024 = 393,216.
    # B*s = 4*32 = 128 tokens: 128 * 1,241,088 = 158,859,264, plus B*s^2*L*6*q = 4*1024*4*6*64 = 6,291,456.
    model = TransformerConfig(num_layers=4, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                              num_query_groups=2, gated_linear_unit=True, add_bias_linear=False, **MOE)
    assert gpt_floating_point_operations(model, 32, 1024, 4) == 165_150_720
    # Megatron core_v0.14's expression (float): 12*L*h*(f*3/2*L_dense/L + F*topk*3/2*L_moe/L + F_s*3/2*L_moe/L).
    megatron_mlp = 12 * 4 * 64 * (128 * 1.5 * 2 / 4 + 32 * 2 * 1.5 * 2 / 4 + 48 * 1.5 * 2 / 4)
    assert megatron_mlp == 552_960
    # Dense (no experts): unchanged, the MLP term is 1152 * 128 * 4.
    dense = dataclasses.replace(model, num_moe_experts=None)
    assert gpt_floating_point_operations(dense, 32, 1024, 4) == 128 * (294_912 + 1152 * 512 + 393_216) + 6_291_456
    # A list pattern: only layer 4 is MoE.
    last = dataclasses.replace(model, moe_layer_freq=[0, 0, 0, 1])
    assert gpt_floating_point_operations(last, 32, 1024, 4) == (
        128 * (294_912 + 1152 * (128 * 3 + 112) + 393_216) + 6_291_456)


def test_parameters_all_and_active(monkeypatch):
    cfg = _config(monkeypatch)
    # Dense layer: norms 128 + qkv (64+64)*64 + proj 64*64 + fc1 2*128*64 + fc2 64*128 = 36,992.
    # MoE layer: norms, qkv, proj 12,416 + router 4*64 + 4 experts * (2*32*64 + 64*32) + shared 3*48*64 = 46,464;
    # active (top-2): 12,416 + 256 + 2*6,144 + 9,216 = 34,176. Embeddings 2 * 1024*64, final norm 64.
    assert num_parameters_in_model(cfg) == 2 * 36_992 + 2 * 46_464 + 131_072 + 64 == 298_048
    assert num_parameters_in_model(cfg, active=True) == 2 * 36_992 + 2 * 34_176 + 131_072 + 64 == 273_472
    # One rank at EP=1 holds the whole model.
    assert num_parameters_on_rank(cfg) == 298_048


def test_expert_parallel_rank_and_bytes(monkeypatch):
    cfg = _config(monkeypatch, ep=2)
    shapes = dict(gpt_parameter_shapes(cfg))
    assert shapes["decoder.layers.0.mlp.router.weight"] == (4, 64)
    assert shapes["decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight"] == (64, 64)
    assert shapes["decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight"] == (64, 32)
    assert "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight" not in shapes  # E/EP = 2 here
    assert shapes["decoder.layers.2.mlp.shared_experts.linear_fc1.weight"] == (96, 64)
    assert "decoder.layers.1.mlp.linear_fc1.weight" in shapes  # layer 2 is dense
    # Each MoE layer keeps 2 of 4 experts: 2 * 6,144 of the 24,576 expert parameters.
    assert num_parameters_on_rank(cfg) == 298_048 - 2 * 12_288 == 273_472
    assert num_expert_parameters_on_rank(cfg) == 2 * 12_288
    # World 2 = DP 2; experts over EP 2 leave expert-DP 1. bf16 + fp32 grads + distributed Adam:
    # 2 + 4 + 12/2 = 12 bytes per dense parameter, 2 + 4 + 12/1 = 18 per expert parameter.
    assert expert_data_parallel_size(cfg) == 1
    assert bytes_per_parameter(cfg).total == 12 and bytes_per_parameter(cfg, expert=True).total == 18
    footprint = compute_weight_and_optimizer_memory(cfg)
    assert footprint.weight_and_optimizer_bytes == (273_472 - 24_576) * 12 + 24_576 * 18 == 3_429_120
    assert footprint.num_active_parameters == 273_472


def test_grouped_gemm_shapes_hold_the_same_parameters(monkeypatch):
    cfg = _config(monkeypatch, ep=2, moe_grouped_gemm=True)
    shapes = dict(gpt_parameter_shapes(cfg))
    assert shapes["decoder.layers.0.mlp.experts.weight1"] == (64, 2 * 64)  # [h, E_loc * 2F]
    assert shapes["decoder.layers.0.mlp.experts.weight2"] == (2 * 32, 64)  # [E_loc * F, h]
    assert num_parameters_on_rank(cfg) == 273_472


def test_activation_estimate_of_an_moe_layer(monkeypatch):
    cfg = _config(monkeypatch, ep=2)
    dense = activation_memory_per_layer(cfg)
    moe = activation_memory_per_layer(cfg, moe=True)
    # s*b = 64 tokens, 2 bytes: the dense MLP's inner 2*64*3*128 is replaced by the shared expert's 2*64*3*48,
    # the router's fp32 logits and probs 2*4*64*4 and the experts' 2*2*64*2*64 + 2*64*2*3*32 (top-2 copies).
    assert moe - dense == pytest.approx(-2 * 64 * 3 * 128 + 2 * 64 * 3 * 48 + 2 * 4 * 64 * 4
                                        + 2 * 2 * 64 * 2 * 64 + 2 * 64 * 2 * 3 * 32)
    # The stage holds two of each; the output side and the embedding do not change with MoE.
    dense_cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, num_moe_experts=None))
    assert compute_activation_memory(cfg, 1) - compute_activation_memory(dense_cfg, 1) == pytest.approx(
        2 * (moe - dense))


def test_refusal_divides_the_experts_by_expert_parallelism(monkeypatch):
    cfg = _config(monkeypatch, ep=2)
    # bf16: (298,048 - 49,152 routed expert parameters) * 2 + 49,152 / 2 * 2 = 546,944 bytes per rank.
    assert model_memory_refusal(cfg, "x", host_memory=546_944) is None
    assert "refusing" in model_memory_refusal(cfg, "x", host_memory=546_943)


def test_megatron_flags_reach_both_figures(monkeypatch):
    """The same model from Megatron's MoE flags (validated args, as Megatron-LM's callers pass them)."""
    from megatron.training.training_log import num_floating_point_operations

    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    args = validate_args(parse_args(args=[
        *FLAGS, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
        "--moe-shared-expert-intermediate-size", "48", "--moe-layer-freq", "2", "--expert-model-parallel-size", "2"]))
    args.padded_vocab_size = 1024
    assert num_floating_point_operations(args, 4) == 165_150_720
    footprint = compute_weight_and_optimizer_memory(args)
    assert (footprint.num_parameters, footprint.num_parameters_on_rank) == (298_048, 273_472)
    assert footprint.weight_and_optimizer_bytes == 3_429_120


@pytest.mark.parametrize("extra", [[], ["--moe-grouped-gemm"]], ids=["sequential", "grouped"])
def test_shapes_match_the_built_moe_model(extra, monkeypatch):
    """The estimator's per-rank shapes are the MoE GPTModel's ``named_parameters`` (EP=2 rank 1, fake backend)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    import pretrain_gpt
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training import global_vars

    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    args = validate_args(parse_args(args=[
        *FLAGS, "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
        "--moe-shared-expert-intermediate-size", "48", "--moe-layer-freq", "2", "--expert-model-parallel-size", "2",
        "--use-cpu-initialization", *extra]))
    args.padded_vocab_size = 1024
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=2)
    try:
        ps.initialize_model_parallel(expert_model_parallel_size=2)
        model_parallel_cuda_manual_seed(1234)
        global_vars.set_args(args)
        model = pretrain_gpt.model_provider(pre_process=True, post_process=True)
        built = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    finally:
        global_vars.set_args(None)
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    assert gpt_parameter_shapes(args) == built
    assert sum(_numel(shape) for _, shape in built) == 273_472


def _numel(shape):
    out = 1
    for size in shape:
        out *= size
    return out


def test_pipeline_stages_place_moe_layers_by_global_number(monkeypatch):
    # moe_layer_freq [1, 0, 0, 1] over PP=2: stage 0 holds layers 1 (MoE) and 2, stage 1 layers 3 and 4 (MoE).
    cfg = _config(monkeypatch)
    cfg.model = dataclasses.replace(cfg.model, pipeline_model_parallel_size=2, moe_layer_freq=[1, 0, 0, 1])
    first, last = dict(gpt_parameter_shapes(cfg, 0)), dict(gpt_parameter_shapes(cfg, 1))
    assert "decoder.layers.0.mlp.router.weight" in first and "decoder.layers.1.mlp.linear_fc1.weight" in first
    assert "decoder.layers.0.mlp.linear_fc1.weight" in last and "decoder.layers.1.mlp.router.weight" in last
