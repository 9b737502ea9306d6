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
    """Our TransformerConfig of the fixture's model (tests/data/mcore_v014/moe/generate_moe.py); a ``-grouped``
    variant runs its experts as GroupedMLP (``moe_grouped_gemm``)."""
    from megatron.core.transformer import TransformerConfig

    if variant.endswith("-etp1"):  # experts not split over TP (expert tensor-parallel size 1)
        variant = variant[:-len("-etp1")]
        overrides = dict(overrides, expert_tensor_parallel_size=1)
    if variant.endswith("-grouped"):
        variant = variant[:-len("-grouped")]
        overrides = dict(overrides, moe_grouped_gemm=True)

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
                       allow_missing=lambda key: key.startswith("optimizer.state.fp32_param."), strict="raise_all",
                       unread_ok=lambda key: key.startswith("optimizer.state.fp32_param."))
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


def test_our_save_has_megatrons_moe_keys_shapes_and_dtypes(tmp_path):
    for variant in ("mixtral", "shared", "mixtral-grouped"):  # GroupedMLP writes SequentialMLP's keys
        ours = run_distributed(_save_layout, 1, variant, str(tmp_path / variant), 1, 1, 1, False)[0][0]
        megatron = _stored(FIXTURE / variant.replace("-grouped", "") / "torch_dist" / "iter_0000003")
        megatron.pop("rng_state/shard_0.0_1.1")
        assert ours == megatron, sorted(set(ours.items()) ^ set(megatron.items()))[:6]


def _stored(iteration_dir):
    """{key: (shape, dtype name)} of a torch_dist ``.metadata`` (byte entries: shape ())."""
    from megatron.core.dist_checkpointing import serialization

    out = {}
    for key, md in serialization.read_metadata(str(iteration_dir)).state_dict_metadata.items():
        properties = getattr(md, "properties", None)
        out[key] = (tuple(getattr(md, "size", ()) or ()), str(getattr(properties, "dtype", "bytes")))
    return out


SAVE_SEED, LOAD_SEED = 11, 5


def _parallel_model(variant, ep, tp, pp, distopt, seed):
    """(model chunk (DDP-wrapped with ``distopt``), optimizer) at this layout, built with ``seed``; expert and
    dense shards are cut from the same full matrices at any layout, so ``seed`` fixes the global weights."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             expert_model_parallel_size=ep,
                                             expert_tensor_parallel_size=1 if "-etp1" in variant else None)
    config = moe_config(variant, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                        expert_model_parallel_size=ep, sequence_parallel=tp > 1)
    model = build_gpt(config, seed, pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage())
    if distopt:
        model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), model)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1,
                                                       use_distributed_optimizer=distopt), [model])
    return model, optimizer


def _unwrapped(model):
    return getattr(model, "module", model)


def _fill_state(model, optimizer):
    """Adam's moments as functions of the weights they belong to (exp_avg = 2w, exp_avg_sq = w^2 + 1, also for the
    distributed optimizer's flat shards), the expert biases as arange: checkable at any layout after a load."""
    from megatron.core.dist_checkpointing import model_and_optimizer as mo

    mo.ensure_optimizer_state(optimizer)
    inner = optimizer.optimizer
    for group in inner.param_groups:
        for param in group["params"]:
            inner.state[param]["exp_avg"].copy_(2 * param.detach())
            inner.state[param]["exp_avg_sq"].copy_(param.detach() ** 2 + 1)
            inner.state[param]["step"] = torch.tensor(4.0)
    for name, buffer in _unwrapped(model).named_buffers():
        if name.endswith("expert_bias"):
            buffer.copy_(torch.arange(buffer.numel(), dtype=buffer.dtype) / 8 + int(name.split(".")[2]))


def _save_layout(rank, world, variant, ckpt_dir, ep, tp, pp, distopt):
    """Save model + Adam at this layout the way --ckpt-format torch_dist does; returns the stored keys (rank 0)."""
    from megatron.core.dist_checkpointing import model_and_optimizer as mo
    from megatron.core.dist_checkpointing import serialization

    model, optimizer = _parallel_model(variant, ep, tp, pp, distopt, SAVE_SEED)
    _fill_state(model, optimizer)
    sharded = mo.model_sharded_state([model], with_objects=True) + mo.optimizer_sharded_state([model], optimizer)
    serialization.save(sharded, ckpt_dir)
    if rank == 0:  # as common.pt: rank 0's unsharded optimizer state
        torch.save({"optimizer": mo.optimizer_common_state(optimizer)}, os.path.join(ckpt_dir, "common_test.pt"))
    torch.distributed.barrier()
    return (_stored(ckpt_dir) if rank == 0 else None), (None if tp > 1 else _global_params(model))


def _global_params(model):
    """{name at PP=1, EP=1: tensor} of this rank's parameters (whole tensors: TP 1)."""
    import re

    from megatron.core import parallel_state

    module = _unwrapped(model)
    offset = module.decoder.layers[0].layer_number - 1 if len(module.decoder.layers) else 0
    local = module.config.num_moe_experts // parallel_state.get_expert_model_parallel_world_size()
    first = parallel_state.get_expert_model_parallel_rank() * local
    out = {}
    for name, param in module.named_parameters():
        name = re.sub(r"^decoder\.layers\.(\d+)\.", lambda m: f"decoder.layers.{int(m.group(1)) + offset}.", name)
        name = re.sub(r"local_experts\.(\d+)\.", lambda m: f"local_experts.{int(m.group(1)) + first}.", name)
        out[name] = param.detach().clone()
    return out


def _load_layout(rank, world, variant, ckpt_dir, ep, tp, pp, distopt, saved=None):
    """Load at this layout into a model built with another seed; every weight equals the model built at this layout
    with the saving seed, every moment is that function of its weight, the expert biases as saved."""
    from megatron.core.dist_checkpointing import model_and_optimizer as mo
    from megatron.core.dist_checkpointing import serialization

    model, optimizer = _parallel_model(variant, ep, tp, pp, distopt, LOAD_SEED)
    mo.ensure_optimizer_state(optimizer)
    metadata = serialization.read_metadata(ckpt_dir)
    reads, finishers = mo.optimizer_load_plan([model], optimizer, metadata.state_dict_metadata)
    serialization.load(mo.model_sharded_state([model]) + reads, ckpt_dir, metadata=metadata,
                       allow_missing=lambda key: key.startswith("optimizer.state.fp32_param."), strict="raise_all",
                       unread_ok=lambda key: key.startswith("optimizer.state.fp32_param."))
    for finish in finishers:
        finish()
    common = torch.load(os.path.join(ckpt_dir, "common_test.pt"), weights_only=True)
    mo.load_optimizer_common_state(optimizer, common["optimizer"], ckpt_dir)
    # the saving ranks' weights by PP=1/EP=1 name (layers of several stages), else the saving seed's model here
    expected = saved or dict(_unwrapped(_parallel_model_again(variant, ep, tp, pp)).named_parameters())
    for name, param in _unwrapped(model).named_parameters():
        assert torch.equal(param.detach(), expected[name].detach()), name
    inner = optimizer.optimizer
    for group in inner.param_groups:
        for param in group["params"]:
            state = inner.state[param]
            assert torch.allclose(state["exp_avg"], 2 * param.detach(), atol=0, rtol=0)
            assert torch.allclose(state["exp_avg_sq"], param.detach() ** 2 + 1, atol=1e-7, rtol=0)
            assert float(state["step"]) == 4.0
    for name, buffer in _unwrapped(model).named_buffers():
        if name.endswith("expert_bias"):
            want = torch.arange(buffer.numel(), dtype=buffer.dtype) / 8 + int(name.split(".")[2])
            assert torch.equal(buffer, want), name
    return sum(p.numel() for p in _unwrapped(model).parameters())


def _parallel_model_again(variant, ep, tp, pp):
    """The saving seed's model at the current (already initialized) layout."""
    from megatron.core import parallel_state

    config = moe_config(variant, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                        expert_model_parallel_size=ep, sequence_parallel=tp > 1)
    return build_gpt(config, SAVE_SEED, pre_process=parallel_state.is_pipeline_first_stage(),
                     post_process=parallel_state.is_pipeline_last_stage())


# (variant saved, saving layout (EP, TP, PP, distributed optimizer), its ranks, variant loaded, loading layout, its
# ranks). Ranks beyond EP x TP x PP are (expert-)data-parallel: 4 ranks at EP=2 shard the experts'
# distributed-optimizer state over 2 expert-data-parallel ranks, whose replicas of the expert weights are written
# once. A "-grouped" variant runs GroupedMLP, which writes SequentialMLP's keys.
RESHARDS = [
    ("mixtral", (2, 1, 1, False), 2, "mixtral", (1, 1, 1, False), 1),
    ("shared", (2, 1, 1, True), 4, "shared", (1, 1, 1, True), 2),
    ("mixtral", (2, 2, 1, False), 4, "mixtral", (1, 1, 1, True), 1),
    ("shared", (2, 1, 2, False), 4, "shared", (1, 1, 1, False), 1),
    ("mixtral", (1, 1, 1, True), 1, "mixtral", (2, 2, 1, True), 4),
    ("mixtral-grouped", (2, 2, 1, False), 4, "mixtral", (1, 1, 1, False), 1),
    ("shared", (1, 1, 1, False), 1, "shared-grouped", (2, 1, 1, False), 2),
    ("mixtral-grouped", (2, 1, 1, True), 4, "mixtral-grouped", (1, 1, 1, True), 2),
    ("mixtral-grouped", (2, 1, 1, True), 4, "mixtral", (1, 1, 1, False), 1),
    # experts whole on each rank under TP=2 (expert tensor-parallel size 1), and back to experts split over TP=2
    ("mixtral-etp1", (2, 2, 1, True), 4, "mixtral", (1, 2, 1, False), 2),
    ("mixtral-grouped", (1, 1, 1, False), 1, "mixtral-grouped-etp1", (2, 2, 1, False), 4),
]


@pytest.mark.parametrize("variant,save,save_world,load_variant,load,load_world", RESHARDS, ids=lambda v: str(v))
def test_moe_checkpoint_reshards_over_ep_tp_pp(variant, save, save_world, load_variant, load, load_world, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    results = run_distributed(_save_layout, save_world, variant, ckpt, *save)
    saved = None
    if save[2] > 1:  # pipeline stages draw their layers' weights from the seed in another order
        assert load == (1, 1, 1, False)
        saved = {}
        for _, params in results:
            saved.update(params)
    counts = run_distributed(_load_layout, load_world, load_variant, ckpt, *load, saved)
    assert all(count > 0 for count in counts)


MOE_RUN = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
           "--seq-length", "16", "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", "100", "--hidden-dropout", "0", "--attention-dropout", "0", "--distributed-backend", "gloo",
           "--disable-bias-linear", "--swiglu", "--ffn-hidden-size", "32", "--num-experts", "4", "--moe-router-topk", "2",
           "--moe-aux-loss-coeff", "1e-2", "--moe-ffn-hidden-size", "24", "--micro-batch-size", "2",
           "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
           "--lr-warmup-iters", "2", "--seed", "1234", "--log-interval", "1", "--mock-data", "--eval-iters", "0",
           "--num-workers", "0", "--train-iters", "10", "--ckpt-format", "torch_dist"]


def _losses(nproc, flags, tb):
    from pretrain_utils import run_ranks, tensorboard_scalars

    result = run_ranks(nproc, [*MOE_RUN, *flags, "--tensorboard-dir", str(tb)], timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return tensorboard_scalars(tb, "lm loss"), result.stdout


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """lm loss of the 10 iterations on one process."""
    return _losses(1, [], tmp_path_factory.mktemp("moe_ref") / "tb")[0]


@pytest.mark.parametrize("extra", [[], ["--moe-grouped-gemm", "--use-distributed-optimizer"]],
                         ids=["sequential", "grouped-distopt"])
def test_torch_dist_checkpoint_saved_at_ep2_resumes_at_ep1_with_the_uninterrupted_losses(uninterrupted, extra,
                                                                                          tmp_path):
    """Saved at EP=2 (SequentialMLP and Adam; or GroupedMLP and the distributed optimizer), resumed at EP=1 by
    SequentialMLP and Adam."""
    save = tmp_path / "ckpt"
    first, _ = _losses(2, ["--expert-model-parallel-size", "2", *extra, "--save", str(save), "--save-interval", "5",
                           "--exit-interval", "5"], tmp_path / "tb_ep2")
    assert sorted(first) == [1, 2, 3, 4, 5]
    if not extra:  # convert.py reads the layout it was saved at (its summary line names EP=2)
        from pretrain_utils import load_checkpoint_tool

        assert load_checkpoint_tool("convert").read_checkpoint(str(save), with_optimizer=False).layout["ep"] == 2
    resumed, out = _losses(1, ["--load", str(save)], tmp_path / "tb_ep1")
    assert sorted(resumed) == [6, 7, 8, 9, 10], out[-2000:]
    for step in range(1, 11):
        got = first[step] if step <= 5 else resumed[step]
        assert abs(got - uninterrupted[step]) < 1e-5, (step, got, uninterrupted[step])


def test_legacy_torch_checkpoint_at_ep2_has_one_file_per_expert_rank_and_resumes(uninterrupted, tmp_path):
    save = tmp_path / "ckpt"
    flags = ["--expert-model-parallel-size", "2", "--ckpt-format", "torch"]
    first, _ = _losses(2, [*flags, "--save", str(save), "--save-interval", "5", "--exit-interval", "5"],
                       tmp_path / "tb_1")
    # mp_rank_{tp:02d}_{ep:03d}, each written by its expert-data-parallel rank 0 (here every rank: EDP = 1)
    assert sorted(p.name for p in (save / "iter_0000005").iterdir() if p.name.startswith("mp_rank")) == \
        ["mp_rank_00_000", "mp_rank_00_001"]
    from megatron.core.dist_checkpointing.safe_loading import load_torch_file

    experts = [sorted(k for k in load_torch_file(str(save / "iter_0000005" / d / "model_optim_rng.pt"), "test")["model"]
                      if "local_experts" in k and k.endswith("weight")) for d in ("mp_rank_00_000", "mp_rank_00_001")]
    assert experts[0] == experts[1] and len(experts[0]) == 2 * 2 * 2  # 2 layers x 2 local experts x fc1, fc2
    resumed, out = _losses(2, [*flags, "--load", str(save)], tmp_path / "tb_2")
    assert sorted(resumed) == [6, 7, 8, 9, 10], out[-2000:]
    for step in range(1, 11):
        got = first[step] if step <= 5 else resumed[step]
        assert abs(got - uninterrupted[step]) < 1e-5, (step, got, uninterrupted[step])

    # tools/checkpoint/convert.py reshards it: to EP=1 (resumes with the uninterrupted losses), EP=4, EP=2 x PP=2
    # and torch_dist, each holding the same weights and moments.
    from pretrain_utils import load_checkpoint_tool

    convert = load_checkpoint_tool("convert")
    targets = {"ep1": ["--target-expert-model-parallel-size", "1"], "ep4": ["--target-expert-model-parallel-size", "4"],
               "ep2pp2": ["--target-pipeline-parallel-size", "2"], "dist": ["--target-ckpt-format", "torch_dist"]}
    dirs = {"ep1": ["mp_rank_00"], "ep4": [f"mp_rank_00_{e:03d}" for e in range(4)],
            "ep2pp2": [f"mp_rank_00_{p:03d}_{e:03d}" for p in range(2) for e in range(2)]}
    source = convert.read_checkpoint(str(save))
    for name, extra in targets.items():
        assert convert.main(["--load-dir", str(save), "--save-dir", str(tmp_path / name), *extra]) == 0
        if name in dirs:
            assert sorted(p.name for p in (tmp_path / name / "iter_0000005").iterdir()
                          if p.name.startswith("mp_rank")) == dirs[name]
        converted = convert.read_checkpoint(str(tmp_path / name))
        assert list(converted.model) == list(source.model), name
        for key, value in source.model.items():
            assert not torch.is_tensor(value) or torch.equal(value, converted.model[key]), (name, key)
        for key, entry in source.optimizer.param_state.items():
            for state, value in entry.items():
                if torch.is_tensor(value) and value.dim():
                    assert torch.equal(value, converted.optimizer.param_state[key][state]), (name, key, state)
    resumed, out = _losses(1, ["--ckpt-format", "torch", "--no-load-rng", "--load", str(tmp_path / "ep1")],
                           tmp_path / "tb_3")
    assert sorted(resumed) == [6, 7, 8, 9, 10], out[-2000:]
    for step in range(6, 11):
        assert abs(resumed[step] - uninterrupted[step]) < 1e-5, (step, resumed[step], uninterrupted[step])


FIXTURE_RUN = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "4",
               "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "32", "--seq-length", "16",
               "--max-position-embeddings", "16", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
               "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
               "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--num-experts", "4",
               "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--moe-router-dtype", "fp32",
               "--moe-aux-loss-coeff", "1e-2", "--mock-data", "--attention-dropout", "0", "--hidden-dropout", "0",
               "--micro-batch-size", "4", "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4",
               "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--clip-grad", "0",
               "--seed", "1234", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "10",
               "--num-workers", "0", "--distributed-backend", "gloo"]


def test_pretrain_gpt_resumes_from_megatrons_moe_checkpoints_in_both_formats(tmp_path):
    """Megatron's legacy file (its 2 param groups hold the expert params with the dense ones at EP=1; ours keep
    them apart) and its torch_dist checkpoint of the same state resume to the same losses."""
    from pretrain_utils import run_ranks, tensorboard_scalars

    losses = {}
    for fmt in ("torch", "torch_dist"):
        tb = tmp_path / fmt
        result = run_ranks(1, [*FIXTURE_RUN, "--ckpt-format", fmt, "--load", str(FIXTURE / "mixtral" / fmt),
                               "--tensorboard-dir", str(tb)], timeout=240)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        losses[fmt] = tensorboard_scalars(tb, "lm loss")
    assert sorted(losses["torch"]) == list(range(4, 11))
    assert losses["torch"] == losses["torch_dist"]


MCORE_PATH = os.environ.get("MCORE_V014_PATH")
SHARED_FLAGS = ["--moe-layer-freq", "[1,0]", "--moe-shared-expert-intermediate-size", "20",
                "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                "--moe-router-bias-update-rate", "1e-2", "--moe-router-load-balancing-type", "none",
                "--moe-aux-loss-coeff", "0"]


def _our_fixture_save(variant, extra, save):
    from pretrain_utils import run_ranks

    flags = [*FIXTURE_RUN, *(SHARED_FLAGS if variant == "shared" else []), *extra]
    flags[flags.index("--train-iters") + 1] = "3"
    result = run_ranks(1, [*flags, "--ckpt-format", "torch_dist", "--save", str(save), "--save-interval", "3"],
                       timeout=240)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return save / "iter_0000003"


@pytest.mark.skipif(not MCORE_PATH, reason="MCORE_V014_PATH (an unpacked megatron-core 0.14.0 wheel) is not set: the "
                    "real megatron-core loads our MoE checkpoints only with it")
@pytest.mark.parametrize("variant,distopt", [("mixtral", False), ("shared", False), ("mixtral", True)])
def test_real_megatron_loads_our_moe_checkpoint_with_our_logits_and_moments(variant, distopt, tmp_path):
    import subprocess
    import sys

    iteration_dir = _our_fixture_save(variant, ["--use-distributed-optimizer"] if distopt else [], tmp_path / "ours")
    out = tmp_path / "megatron.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=MCORE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(REPO / "tests" / "mcore_reference" / "load_torch_dist_moe.py"),
                             variant, str(iteration_dir), str(out), *(["--distributed-optimizer"] if distopt else [])],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    megatron = torch.load(out, weights_only=True)
    logits, moments, _, biases = run_distributed(_load_our_save, 1, variant, str(iteration_dir))[0]
    assert torch.allclose(megatron["logits"], logits, atol=1e-5, rtol=0), (megatron["logits"] - logits).abs().max()
    assert sorted(megatron["names"]) == sorted(moments)
    for i, name in enumerate(megatron["names"]):
        assert megatron["exp_avg_norm"][i].item() == pytest.approx(moments[name][0], rel=1e-6), name
        assert megatron["exp_avg_sq_norm"][i].item() == pytest.approx(moments[name][1], rel=1e-6), name
        assert moments[name][1] > 0, name
    assert sorted(megatron["expert_bias"]) == sorted(biases)
    for name, value in biases.items():
        assert torch.equal(megatron["expert_bias"][name], value), name


def _load_our_save(rank, world, variant, iteration_dir):
    return _load_fixture(rank, world, variant, os.path.dirname(iteration_dir))


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_export_hf_writes_a_mixtral_with_megatrons_logits(fmt, tmp_path):
    """Megatron's MoE fixture exported to transformers' MixtralForCausalLM: its logits equal the ones megatron-core
    computed (1e-5, the padded vocabulary rows aside)."""
    transformers = pytest.importorskip("transformers", reason="export_hf needs transformers")
    pytest.importorskip("safetensors", reason="export_hf needs safetensors")
    from pretrain_utils import load_checkpoint_tool

    export = load_checkpoint_tool("export_hf")
    hf_dir = tmp_path / "hf"
    assert export.main(["--load", str(FIXTURE / "mixtral" / fmt), "--save", str(hf_dir), "--vocab-size", "101",
                        "--no-tokenizer", "--no-verify-checkpoint"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    assert type(model).__name__ == "MixtralForCausalLM"
    reference = torch.load(FIXTURE / "mixtral" / "reference.pt", weights_only=True)
    model.eval()
    with torch.no_grad():
        logits = model(reference["input_ids"]).logits
    expected = reference["logits"][..., :101]
    assert torch.allclose(logits, expected, atol=1e-5, rtol=0), (logits - expected).abs().max()


def test_import_hf_reads_the_exported_mixtral_back(tmp_path):
    pytest.importorskip("transformers", reason="import_hf needs transformers")
    pytest.importorskip("safetensors", reason="import_hf needs safetensors")
    from pretrain_utils import load_checkpoint_tool

    export, importer = load_checkpoint_tool("export_hf"), load_checkpoint_tool("import_hf")
    convert = load_checkpoint_tool("convert")
    source = FIXTURE / "mixtral" / "torch"
    assert export.main(["--load", str(source), "--save", str(tmp_path / "hf"), "--vocab-size", "101",
                        "--no-tokenizer", "--no-verify-checkpoint"]) == 0
    assert importer.main(["--load", str(tmp_path / "hf"), "--save", str(tmp_path / "back"),
                          "--target-tensor-parallel-size", "2"]) == 0
    original = convert.read_checkpoint(str(source), verify=False, with_optimizer=False).model
    back = convert.read_checkpoint(str(tmp_path / "back"), with_optimizer=False)
    assert back.layout["tp"] == 2 and back.args.num_experts == 4 and back.args.moe_router_topk == 2
    assert sorted(back.model) == sorted(original)
    for key, value in original.items():
        if torch.is_tensor(value):
            rows = 101 if "word_embeddings" in key or key.startswith("output_layer") else value.shape[0]
            assert torch.equal(back.model[key][:rows], value[:rows]), key


def test_legacy_torch_checkpoint_at_ep1_groups_experts_as_megatron_and_resumes(uninterrupted, tmp_path):
    """At EP=1 Megatron keeps the expert params in the dense param groups: our legacy file does too (so Megatron-LM's
    load_checkpoint reads it, tests/test_megatron_load_checkpoint.py), and our resume maps them back by name."""
    from megatron.core.dist_checkpointing.safe_loading import load_torch_file

    save = tmp_path / "ckpt"
    _losses(1, ["--ckpt-format", "torch", "--save", str(save), "--save-interval", "5", "--exit-interval", "5"],
            tmp_path / "tb_1")
    saved = load_torch_file(str(save / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt"), "test")
    groups = saved["optimizer"]["param_groups"]
    assert [(g["wd_mult"], g["is_expert_parallel"]) for g in groups] == [(1.0, False), (0.0, False)]
    assert any("local_experts" in name for name in groups[0]["param_names"])
    resumed, out = _losses(1, ["--ckpt-format", "torch", "--load", str(save)], tmp_path / "tb_2")
    assert sorted(resumed) == [6, 7, 8, 9, 10], out[-2000:]
    for step in range(6, 11):
        assert abs(resumed[step] - uninterrupted[step]) < 1e-5, (step, resumed[step], uninterrupted[step])


def test_parallel_layout_record_names_the_expert_parallel_size():
    """RNG states are restored only at the saved layout: EP=2 and EP=1 over the same ranks are two layouts (each
    expert-parallel rank has its own expert-parallel RNG stream); EP=1 records keep their earlier bytes."""
    from megatron.training.checkpointing import layout

    assert layout.parallel_layout(1, 1, 2, expert_model_parallel_size=2) != layout.parallel_layout(1, 1, 2)
    assert layout.parallel_layout(1, 1, 2, expert_model_parallel_size=1) == layout.parallel_layout(1, 1, 2)
    assert "expert_model_parallel_size" not in layout.parallel_layout(1, 1, 2)
