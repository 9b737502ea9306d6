"""Megatron-LM core_v0.14.0's own ``load_checkpoint`` loads our torch_dist distributed-optimizer checkpoints.

pretrain_gpt.py saves, on the CPU with ``--use-distributed-optimizer --ckpt-format torch_dist``, a GPT-2
shape (LayerNorm, biases, GeLU, learned positions, tied embeddings; one rank) and a Llama shape (RMSNorm,
SwiGLU, RoPE, grouped-query attention, no biases, untied output; two data-parallel ranks, and once two
tensor-parallel ranks); then the Llama shape in the legacy ``torch`` format (Adam, not distributed), read
as written and after tools/checkpoint/convert.py made a torch_dist checkpoint of it.
tests/mcore_reference/megatron_load_checkpoint.py then runs Megatron-LM's code path for
``pretrain_gpt.py --load`` on each (its parse_args, model_provider with the local spec,
DistributedDataParallel, get_megatron_optimizer's DistributedOptimizer, the scheduler and
``megatron.training.checkpointing.load_checkpoint``, which reads ``common.pt``'s ``content_metadata``
and the RNG states: no ``--no-load-rng``). Every weight and every Adam ``exp_avg`` / ``exp_avg_sq``
Megatron ends up with must equal the saved tensors exactly, its logits must equal ours, and the
iteration, Adam steps, scheduler and the CUDA RNG states it restored must be the saved ones.

Needs, outside this project (the test skips without them; docs/testing.md says how to get them):
``MCORE_V014_PATH``: an unpacked megatron-core 0.14.0 wheel; ``MEGATRON_LM_V014_PATH``: a
Megatron-LM checkout at tag core_v0.14.0 (its megatron/training; the wheel has only megatron/core).
"""
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import REPO, load_checkpoint_tool, run_ranks

pytestmark = pytest.mark.timeout(600)

MCORE_PATH = os.environ.get("MCORE_V014_PATH")
MEGATRON_LM_PATH = os.environ.get("MEGATRON_LM_V014_PATH")
SKIP_REASON = ("needs MCORE_V014_PATH (an unpacked megatron-core 0.14.0 wheel) and MEGATRON_LM_V014_PATH (a "
               "Megatron-LM checkout at tag core_v0.14.0); see docs/testing.md")
REFERENCE = REPO / "tests" / "data" / "mcore_v014" / "reference.pt"  # input_ids / position_ids [2, 32]
SEED = 1234

# Flags both sides read the same way (the model, the optimizer and its schedule).
COMMON = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
          "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
          "--attention-dropout", "0", "--hidden-dropout", "0", "--global-batch-size", "4", "--lr", "1e-3",
          "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--weight-decay", "0.1",
          "--clip-grad", "0", "--seed", str(SEED), "--train-iters", "3"]
DIST_OPT = ["--ckpt-format", "torch_dist", "--use-distributed-optimizer"]
LLAMA = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--moe-aux-loss-coeff", "1e-2",
       "--moe-router-dtype", "fp32"]
SHAPES = {
    # name: (model and format flags, ranks that save, their micro batch size, flags of the save only,
    #        converted to torch_dist by tools/checkpoint/convert.py)
    "gpt2": (DIST_OPT, 1, 4, [], False),
    "llama": ([*DIST_OPT, *LLAMA], 2, 2, [], False),
    # saved at TP 2 (gate/up fragments of two ranks), read by Megatron at TP 1 (it ignores the RNG states then)
    "llama-tp2": ([*DIST_OPT, *LLAMA], 2, 4, ["--tensor-model-parallel-size", "2"], False),
    # the legacy format too (Adam, not distributed): Megatron reads the same RNG states from model_optim_rng.pt
    "llama-torch-format": (["--ckpt-format", "torch", *LLAMA], 1, 4, [], False),
    # and that checkpoint after tools/checkpoint/convert.py --target-ckpt-format torch_dist
    "llama-converted": (["--ckpt-format", "torch", *LLAMA], 1, 4, [], True),
    # mixture of experts (Mixtral-like): torch_dist with the distributed optimizer, and the legacy format
    "moe": ([*DIST_OPT, *LLAMA, *MOE], 1, 4, [], False),
    "moe-torch-format": (["--ckpt-format", "torch", *LLAMA, *MOE], 1, 4, [], False),
}
# Megatron-LM on a CPU without Transformer Engine or Apex: the local spec and no fused kernels.
MEGATRON_ONLY = ["--transformer-impl", "local", "--use-cpu-initialization", "--no-gradient-accumulation-fusion",
                 "--no-masked-softmax-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
                 "--no-bias-swiglu-fusion", "--no-persist-layer-norm", "--no-rope-fusion",
                 "--exit-on-missing-checkpoint"]


@pytest.fixture(scope="module")
def megatron_paths():
    if not (MCORE_PATH and MEGATRON_LM_PATH):
        pytest.skip(SKIP_REASON)
    assert (Path(MCORE_PATH) / "megatron" / "core" / "dist_checkpointing").is_dir(), \
        f"MCORE_V014_PATH={MCORE_PATH} holds no megatron/core (unpack the megatron-core 0.14.0 wheel there)"
    assert (Path(MEGATRON_LM_PATH) / "megatron" / "training" / "checkpointing.py").is_file(), \
        f"MEGATRON_LM_V014_PATH={MEGATRON_LM_PATH} holds no megatron/training (a Megatron-LM checkout)"
    return f"{MCORE_PATH}{os.pathsep}{MEGATRON_LM_PATH}"


def _saved_tensors(iteration_dir):
    """The checkpoint's tensors, whole, under per-layer names (as tools/checkpoint/convert.py reads them):
    ``{model name: tensor}``, ``{model name: {state: tensor}}`` (the distributed optimizer's fragments
    put back in parameter shape)."""
    convert = load_checkpoint_tool("convert")
    full = convert.read_checkpoint(str(Path(iteration_dir).parent))
    weights = {k: v for k, v in full.model.items() if torch.is_tensor(v)}
    return weights, full.optimizer.param_state


def _our_logits(rank, world, flags, save_dir):
    """This project's model for ``flags`` with the weights saved in ``save_dir``; its logits on REFERENCE."""
    import importlib.util

    from megatron.core import parallel_state
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.global_vars import set_args

    args = parse_args(args=[*flags, "--mock-data", "--micro-batch-size", "4"])
    validate_args(args)
    args.padded_vocab_size = 1024
    set_args(args)
    parallel_state.initialize_model_parallel()
    spec = importlib.util.spec_from_file_location("ours_pretrain_gpt", REPO / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(7)
    model = module.model_provider()
    weights, _ = _saved_tensors(os.path.join(save_dir, "iter_0000003"))
    model.load_state_dict(weights, strict=False)  # strict=False: the linears' _extra_state
    assert all(torch.equal(p, weights[name]) for name, p in model.named_parameters())
    reference = torch.load(REFERENCE, weights_only=True)
    mask = torch.tril(torch.ones(32, 32)).view(1, 1, 32, 32) < 0.5
    model.eval()
    with torch.no_grad():
        return model(reference["input_ids"], reference["position_ids"], mask)


def _cuda_state(seed):
    # torch's CUDA generator state right after torch.cuda.manual_seed(seed): uint64 seed, int64 offset 0.
    return torch.tensor(list(struct.pack("<Qq", seed, 0)), dtype=torch.uint8)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_megatron_load_checkpoint_reads_our_checkpoint(shape, megatron_paths, tmp_path):
    model_flags, ranks, micro, save_only, converted = SHAPES[shape]
    save = tmp_path / "ckpt"
    result = run_ranks(ranks, ["pretrain_gpt.py", *COMMON, *model_flags, *save_only, "--micro-batch-size", str(micro),
                               "--mock-data", "--distributed-backend", "gloo", "--eval-iters", "0",
                               "--log-interval", "1", "--save", str(save), "--save-interval", "3"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if converted:
        source, save = save, tmp_path / "converted"
        assert load_checkpoint_tool("convert").main(["--load-dir", str(source), "--save-dir", str(save),
                                                     "--target-ckpt-format", "torch_dist"]) == 0
        model_flags = [*model_flags[:model_flags.index("--ckpt-format")], "--ckpt-format", "torch_dist",
                       *model_flags[model_flags.index("--ckpt-format") + 2:]]

    out = tmp_path / "megatron.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=megatron_paths, OMP_NUM_THREADS="1")
    flags = [*COMMON, *model_flags, "--micro-batch-size", "4", *MEGATRON_ONLY, "--load", str(save)]
    run = subprocess.run([sys.executable, str(REPO / "tests" / "mcore_reference" / "megatron_load_checkpoint.py"),
                          str(out), str(REFERENCE), "--", *flags],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "successfully loaded checkpoint" in run.stdout, run.stdout[-3000:]
    megatron = torch.load(out, weights_only=True)

    assert megatron["iteration"] == 3
    if "--use-distributed-optimizer" in model_flags:
        assert megatron["content_metadata"] == {
            "distrib_optim_sharding_type": "fully_sharded_model_space", "chained_optim_avoid_prefix": True,
            "singleton_local_shards": False}
    assert megatron["steps"] and set(megatron["steps"]) == {3.0}
    assert megatron["scheduler_num_steps"] == 3 * 4
    assert megatron["consumed_train_samples"] == 3 * 4

    weights, moments = _saved_tensors(save / "iter_0000003")
    assert sorted(megatron["names"]) == sorted(weights)
    for i, name in enumerate(megatron["names"]):
        assert torch.equal(megatron["weights"][i], weights[name]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(megatron[key][i], moments[name][key]), (name, key)
        assert moments[name]["exp_avg_sq"].abs().sum() > 0, name  # trained: real moments were compared

    ours = run_distributed(_our_logits, 1, [*COMMON, *model_flags], str(save))[0]
    assert torch.allclose(megatron["logits"], ours, atol=1e-5, rtol=0), (megatron["logits"] - ours).abs().max()

    if save_only:  # another TP size: Megatron leaves the RNG states alone
        assert "RNG state will be ignored" in run.stdout and "cuda_rng_state" not in megatron
        return
    # The RNG states Megatron restored (without --no-load-rng): CUDA generator states of the run's seeds
    # (Megatron's model_parallel_cuda_manual_seed offsets), what a GPU run has right after seeding.
    assert torch.equal(megatron["cuda_rng_state"], _cuda_state(SEED))
    expected = {"data-parallel-rng": SEED, "model-parallel-rng": SEED + 2718, "expert-parallel-rng": SEED + 1024}
    assert sorted(megatron["rng_tracker_states"]) == sorted(expected)
    for name, seed in expected.items():
        assert torch.equal(megatron["rng_tracker_states"][name], _cuda_state(seed)), name
