"""torch_dist checkpoints move both ways between this project and Megatron-LM core_v0.14.0.

Megatron -> here: tests/data/mcore_v014/torch_dist (written by the real megatron-core 0.14.0, see its
README) loads into our GPTModel and Adam: the logits equal the writer's, every Adam moment sits on
the parameter of the same name, and pretrain_gpt.py resumes training from it.

Here -> Megatron: pretrain_gpt.py's torch_dist save of the same model has exactly the fixture's
``.metadata`` keys, shapes and dtypes (with the distributed optimizer: Megatron's flattened
``fully_sharded_model_space`` entries) and its ``metadata.json``; with MCORE_V014_PATH pointing at an
unpacked megatron-core 0.14.0 wheel, real Megatron loads it with dist_checkpointing.load into its
model and optimizer and gets our logits and moments (tests/mcore_reference/load_torch_dist.py).
Resharding (TP/PP/DP/distributed optimizer) is covered by tests/test_dist_checkpointing.py.
"""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import REPO, run_ranks

pytestmark = pytest.mark.timeout(300)

FIXTURE = REPO / "tests" / "data" / "mcore_v014"
MEGATRON_ITER = FIXTURE / "torch_dist" / "iter_0000003"
MCORE_PATH = os.environ.get("MCORE_V014_PATH")
# pretrain_gpt.py flags of the fixture's model and training (tests/data/mcore_v014/README.md).
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
         "--mock-data", "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", "4",
         "--global-batch-size", "4", "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
         "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--clip-grad", "0", "--seed", "1234",
         "--distributed-backend", "gloo", "--log-interval", "1", "--eval-iters", "0", "--ckpt-format", "torch_dist"]


def _load_and_evaluate(rank, world, iteration_dir):
    """Our 2-layer model + Adam loaded from ``iteration_dir`` as _load_torch_dist does; returns the logits
    on the fixture's batch, {param name: (|exp_avg|, |exp_avg_sq|)} and the set of Adam steps."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import model_and_optimizer as mo
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.training.checkpointing import load_state_dict_file

    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128,
                               hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(7)  # other weights than the checkpoint's
    model = GPTModel(config, vocab_size=1024, max_sequence_length=32, share_embeddings_and_output_weights=True)
    optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, weight_decay=0.1), [model])
    common = load_state_dict_file(os.path.join(iteration_dir, "common.pt"), "test")
    metadata = serialization.read_metadata(iteration_dir)
    mo.ensure_optimizer_state(optimizer)
    reads, finishers = mo.optimizer_load_plan([model], optimizer, metadata.state_dict_metadata)
    serialization.load(mo.model_sharded_state([model]) + reads, iteration_dir, metadata=metadata,
                       allow_missing=lambda key: key.startswith("optimizer.state.fp32_param."))
    for finish in finishers:
        finish()
    mo.load_optimizer_common_state(optimizer, common["optimizer"], iteration_dir)
    reference = torch.load(FIXTURE / "reference.pt", weights_only=True)
    mask = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32) < 0.5
    model.eval()
    with torch.no_grad():
        logits = model(reference["input_ids"], reference["position_ids"], mask)
    inner = optimizer.optimizer
    moments = {name: tuple(inner.state[p][key].double().norm().item() for key in ("exp_avg", "exp_avg_sq"))
               for name, p in model.named_parameters()}
    steps = {float(state["step"]) for state in inner.state.values()}
    return logits, moments, steps


def _stored(iteration_dir):
    """{key: (shape, dtype name)} of a torch_dist ``.metadata`` (byte entries: shape ())."""
    from megatron.core.dist_checkpointing import serialization

    out = {}
    for key, md in serialization.read_metadata(str(iteration_dir)).state_dict_metadata.items():
        properties = getattr(md, "properties", None)
        out[key] = (tuple(getattr(md, "size", ()) or ()), str(getattr(properties, "dtype", "bytes")))
    return out


def test_megatron_written_checkpoint_loads_with_the_writers_logits_and_adam_moments():
    reference = torch.load(FIXTURE / "reference.pt", weights_only=True)
    logits, moments, steps = run_distributed(_load_and_evaluate, 1, str(MEGATRON_ITER))[0]
    assert logits.shape == reference["logits"].shape
    assert torch.allclose(logits, reference["logits"], atol=1e-5, rtol=0), (logits - reference["logits"]).abs().max()
    assert sorted(moments) == sorted(reference["param_names"])
    for i, name in enumerate(reference["param_names"]):  # each moment on the parameter of its name
        assert moments[name][0] == pytest.approx(reference["exp_avg_norm"][i].item(), rel=1e-6), name
        assert moments[name][1] == pytest.approx(reference["exp_avg_sq_norm"][i].item(), rel=1e-6), name
    assert steps == {3.0}


def test_pretrain_gpt_resumes_training_from_the_megatron_checkpoint():
    # --train-iters 10 as the writer's scheduler (its decay steps are checked against the checkpoint's)
    result = run_ranks(1, ["pretrain_gpt.py", *FLAGS, "--train-iters", "10", "--load", str(FIXTURE / "torch_dist")])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "loaded checkpoint" in out.lower() or "successfully loaded" in out.lower(), out[-2000:]
    losses = {}
    for line in out.splitlines():
        if "elapsed time per iteration" in line and "lm loss:" in line:
            iteration = int(line.split("iteration")[1].split("/")[0])
            losses[iteration] = float(line.split("lm loss:")[1].split("|")[0])
    assert sorted(losses) == list(range(4, 11))  # it continued where Megatron stopped
    # Megatron's own losses on these random tokens were about ln(1024); the loaded model is as trained.
    reference = torch.load(FIXTURE / "reference.pt", weights_only=True)
    for loss in losses.values():
        assert math.isfinite(loss) and abs(loss - reference["losses"][-1]) < 0.5


@pytest.fixture(scope="module")
def our_checkpoints(tmp_path_factory):
    """pretrain_gpt.py torch_dist saves at iteration 3 of the fixture's run: {'adam': dir, 'distopt': dir}."""
    out = {}
    for name, extra in (("adam", []), ("distopt", ["--use-distributed-optimizer"])):
        save = tmp_path_factory.mktemp(name)
        result = run_ranks(1, ["pretrain_gpt.py", *FLAGS, *extra, "--train-iters", "3", "--save", str(save),
                               "--save-interval", "3"])
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        out[name] = save / "iter_0000003"
    return out


def test_our_save_has_megatrons_keys_shapes_dtypes_and_files(our_checkpoints):
    megatron = _stored(MEGATRON_ITER)
    assert _stored(our_checkpoints["adam"]) == megatron
    for name in ("adam", "distopt"):
        assert json.loads((our_checkpoints[name] / "metadata.json").read_text()) == \
            json.loads((MEGATRON_ITER / "metadata.json").read_text())
    # The distributed optimizer: Megatron's fully_sharded_model_space entries (exp_avg, exp_avg_sq and
    # the fp32 main param, each [layers?, fragments per dimension (1 at TP 1), numel of one fragment]).
    distopt = _stored(our_checkpoints["distopt"])
    models = {k: v for k, v in megatron.items() if not k.startswith("optimizer.")}
    expected = dict(models)
    for key, (shape, dtype) in models.items():
        if dtype == "bytes" or key == "rng_state" or "/shard_" in key:
            continue
        layered = key.startswith("decoder.layers.")
        param = shape[1:] if layered else shape
        flat = (*shape[:1 if layered else 0], *([1] * len(param)), math.prod(param))
        for state in ("exp_avg", "exp_avg_sq", "fp32_param"):
            expected[f"optimizer.state.{state}.{key}"] = (flat, dtype)
    assert distopt == expected


@pytest.mark.skipif(not MCORE_PATH, reason="MCORE_V014_PATH (an unpacked megatron-core 0.14.0 wheel) is not set")
@pytest.mark.parametrize("name", ["adam", "distopt"])
def test_real_megatron_loads_our_checkpoint_with_our_logits_and_moments(name, our_checkpoints, tmp_path):
    iteration_dir = our_checkpoints[name]
    out = tmp_path / "megatron.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=MCORE_PATH, OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(REPO / "tests" / "mcore_reference" / "load_torch_dist.py"),
                             str(iteration_dir), str(FIXTURE / "reference.pt"), str(out),
                             *(["--distributed-optimizer"] if name == "distopt" else [])],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    megatron = torch.load(out, weights_only=True)
    # Ours, loaded into the non-distributed Adam (the distopt checkpoint's fragments put back in shape).
    logits, moments, _ = run_distributed(_load_and_evaluate, 1, str(iteration_dir))[0]
    assert torch.allclose(megatron["logits"], logits, atol=1e-5, rtol=0), (megatron["logits"] - logits).abs().max()
    assert sorted(megatron["names"]) == sorted(moments)
    for i, param in enumerate(megatron["names"]):
        assert megatron["exp_avg_norm"][i].item() == pytest.approx(moments[param][0], rel=1e-6), param
        assert megatron["exp_avg_sq_norm"][i].item() == pytest.approx(moments[param][1], rel=1e-6), param
        assert moments[param][1] > 0, param  # trained: real moments were compared


def _save_per_layer_then_load(rank, world, ckpt_dir):
    """Write this project's earlier per-layer layout (model + Adam), load it into fresh objects."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import model_and_optimizer as mo
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0)

    def build(seed):
        torch.manual_seed(seed)
        model = GPTModel(config, vocab_size=128, max_sequence_length=16)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
        mo.ensure_optimizer_state(optimizer)
        for state in optimizer.optimizer.state.values():
            for value in state.values():
                value.normal_()
        return model, optimizer

    model, optimizer = build(1)
    old = mo.model_sharded_state([model], legacy=True)
    for target in mo._optimizer_targets([model], optimizer):
        old += mo._plain(target, mo.optimizer_key(target.name, target.info.entry, legacy=True), stack=False)
    serialization.save(old, ckpt_dir)
    stored = serialization.read_metadata(ckpt_dir).state_dict_metadata
    assert "decoder.layers.1.input_layernorm.weight" in stored and mo.is_per_layer_layout(stored)

    fresh, fresh_optimizer = build(2)
    reads, finishers = mo.optimizer_load_plan([fresh], fresh_optimizer, stored, legacy=True)
    serialization.load(mo.model_sharded_state([fresh], legacy=True) + reads, ckpt_dir)
    assert not finishers
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(optimizer.optimizer.state[a][key], fresh_optimizer.optimizer.state[b][key]), name
    return True


def test_checkpoints_of_the_earlier_per_layer_layout_still_load(tmp_path):
    assert run_distributed(_save_per_layer_then_load, 1, str(tmp_path / "ckpt"))[0]


def _save_old_swiglu_layout_then_load(rank, world, ckpt_dir):
    """A SwiGLU model's distributed-optimizer moments written in this project's earlier TP-1 layout
    (fc1 one fragment, ``[L, 1, 1, 2 * ffn * h]``) load into a fresh distributed optimizer, which
    writes Megatron's ``[L, 2, 1, ffn * h]`` (gate and up fragments) now."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing import model_and_optimizer as mo
    from megatron.core.dist_checkpointing import serialization
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel()
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                               gated_linear_unit=True, activation_func=torch.nn.functional.silu,
                               add_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0)

    def build(seed):
        torch.manual_seed(seed)
        module = GPTModel(config, vocab_size=128, max_sequence_length=16)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True), module)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, use_distributed_optimizer=True),
                                           [model])
        mo.ensure_optimizer_state(optimizer)
        for state in optimizer.optimizer.state.values():
            for value in state.values():
                value.normal_()
        return model, optimizer

    def moments(model, optimizer):
        return {(mo.optimizer_key(t.name, t.info.entry), t.start): t.tensor.clone()
                for t in mo._optimizer_targets([model], optimizer) if t.load}

    model, optimizer = build(1)
    new_shapes = {item.key: item.global_shape for item in mo.optimizer_sharded_state([model], optimizer)}
    fc1 = "decoder.layers.mlp.linear_fc1"
    assert new_shapes[f"optimizer.state.exp_avg.{fc1}.weight"] == (2, 2, 1, 64 * 32)
    assert new_shapes[f"optimizer.state.exp_avg.{fc1}.bias"] == (2, 2, 64)
    from megatron.core.models.gpt import checkpoint_keys  # where _layout lives since the split

    layout = checkpoint_keys._layout
    try:  # the earlier layout: no fragments at TP 1
        checkpoint_keys._layout = lambda tensor: mo.TPLayout(tuple(tensor.shape), None, 1, 0, 1)
        old = mo.model_sharded_state([model]) + mo.optimizer_sharded_state([model], optimizer)
    finally:
        checkpoint_keys._layout = layout
    assert {item.global_shape for item in old if item.key == f"optimizer.state.exp_avg.{fc1}.weight"} == \
        {(2, 1, 1, 2 * 64 * 32)}
    serialization.save(old, ckpt_dir)

    fresh, fresh_optimizer = build(2)
    stored = serialization.read_metadata(ckpt_dir).state_dict_metadata
    reads, finishers = mo.optimizer_load_plan([fresh], fresh_optimizer, stored)
    serialization.load(mo.model_sharded_state([fresh]) + reads, ckpt_dir)
    for finish in finishers:
        finish()
    assert finishers  # the fc1 tensors were reassembled from the one-fragment form
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name
    before, after = moments(model, optimizer), moments(fresh, fresh_optimizer)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    return True


def test_swiglu_distributed_optimizer_checkpoints_of_the_earlier_tp1_layout_still_load(tmp_path):
    assert run_distributed(_save_old_swiglu_layout_then_load, 1, str(tmp_path / "ckpt"))[0]
