"""--use-torch-fsdp2 end to end: FSDP2 at DP=2 and DP=2 x TP=2 trains as one process does, its torch_dist
checkpoints resume without FSDP (one process, TP=2, PP=2) and a one-process checkpoint resumes under FSDP2, and
the flag combinations Megatron-LM refuses are refused in one line each.

Every run trains the 2-layer test GPT in fp32 without dropout on gloo ranks; losses and grad norms are
read from TensorBoard (float32) and compared within 1e-5 relative, so are the params norm
(--log-params-norm) and, within 8 of 1.6M, the zero count of the grads (--log-num-zeros-in-grad). The vocabulary is padded to 50304
rows at TP 1 and 2 (--make-vocab-size-divisible-by 64), so every layout trains the same model.
"""
import os

import pytest

from pretrain_utils import run_pretrain, tensorboard_scalars

pytestmark = pytest.mark.timeout(300)

SAVE_AT, ITERS = 5, 10
COMMON = ["--micro-batch-size", "2", "--hidden-dropout", "0", "--attention-dropout", "0", "--eval-interval", "100",
          "--make-vocab-size-divisible-by", "64", "--untie-embeddings-and-output-weights",
          "--no-gradient-accumulation-fusion", "--log-params-norm", "--log-num-zeros-in-grad"]
FSDP2 = ["--use-torch-fsdp2"]


def _run(nproc, layout_flags, tmp_path, name, shared_data, prefix, load=None, save=True):
    tb = tmp_path / f"tb_{name}"
    flags = [*COMMON, *layout_flags, "--train-iters", str(ITERS), "--tensorboard-dir", str(tb)]
    if save:
        flags += ["--save", str(tmp_path / f"ckpt_{name}"), "--save-interval", str(SAVE_AT)]
    if load is not None:
        flags += ["--load", str(load)]
    out = run_pretrain(nproc, flags, shared_data, prefix, tmp_path)
    run = dict(out=out, loss=tensorboard_scalars(tb, "lm loss"), grad_norm=tensorboard_scalars(tb, "grad-norm"),
               params_norm=tensorboard_scalars(tb, "params-norm"), zeros=tensorboard_scalars(tb, "num-zeros"),
               ckpt=tmp_path / f"ckpt_{name}")
    if save:
        assert os.path.isfile(run["ckpt"] / f"iter_{SAVE_AT:07d}" / ".metadata")
        # Resumes start from SAVE_AT (the run saved ITERS too).
        (run["ckpt"] / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    return run


def _assert_same(run, reference, iterations, grad_norms=True):
    assert sorted(run["loss"]) == list(iterations)
    for iteration in iterations:
        assert run["loss"][iteration] == pytest.approx(reference["loss"][iteration], rel=1e-5), iteration
        if grad_norms:
            assert run["grad_norm"][iteration] == pytest.approx(reference["grad_norm"][iteration], rel=1e-5), iteration
            assert run["params_norm"][iteration] == pytest.approx(reference["params_norm"][iteration], rel=1e-5)
            # A grad that sums to exactly 0 in one reduction order may not in another: a few of 1.6M.
            assert run["zeros"][iteration] == pytest.approx(reference["zeros"][iteration], abs=8), iteration
    assert reference["loss"][iterations[-1]] < reference["loss"][1]  # it learns: the comparison means something


@pytest.fixture(scope="module")
def one_process(shared_data, shakespeare_prefix, tmp_path_factory):
    """The reference: one process, no FSDP, saving at 5 and going on to 10."""
    return _run(1, [], tmp_path_factory.mktemp("one"), "one", shared_data, shakespeare_prefix)


@pytest.fixture(scope="module")
def fsdp_dp2(shared_data, shakespeare_prefix, tmp_path_factory):
    """--use-torch-fsdp2 at DP=2, saving at 5 and going on to 10."""
    return _run(2, FSDP2, tmp_path_factory.mktemp("fsdp"), "fsdp", shared_data, shakespeare_prefix)


def test_fsdp2_dp2_gives_the_losses_and_grad_norms_of_one_process(fsdp_dp2, one_process):
    _assert_same(fsdp_dp2, one_process, range(1, ITERS + 1))
    # The clip (--clip-grad 1.0) acted on the sharded grads: norms above 1 occur.
    assert max(one_process["grad_norm"].values()) > 1.0


def test_fsdp2_dp2_tp2_gives_the_losses_and_grad_norms_of_one_process(one_process, shared_data, shakespeare_prefix,
                                                                      tmp_path):
    run = _run(4, [*FSDP2, "--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path, "fsdp_tp2",
               shared_data, shakespeare_prefix, save=False)
    _assert_same(run, one_process, range(1, ITERS + 1))


def test_fsdp2_prefetch_no_reshard_and_per_token_loss_give_the_same_losses(one_process, shared_data,
                                                                           shakespeare_prefix, tmp_path):
    """--overlap-grad-reduce (reduce-scatter every micro-batch, backward prefetch), --overlap-param-gather
    (forward prefetch) and --torch-fsdp2-no-reshard-after-forward change when, not what, is communicated;
    --calculate-per-token-loss (every token counts here, so the same loss) sums the grads over DP and
    divides by the global token count."""
    run = _run(2, [*FSDP2, "--overlap-grad-reduce", "--overlap-param-gather", "--torch-fsdp2-no-reshard-after-forward",
                   "--calculate-per-token-loss"], tmp_path, "fsdp_overlap", shared_data, shakespeare_prefix, save=False)
    _assert_same(run, one_process, range(1, ITERS + 1))


@pytest.mark.parametrize("nproc,layout", [(1, []), (2, ["--tensor-model-parallel-size", "2"]),
                                          (2, ["--pipeline-model-parallel-size", "2"])],
                         ids=["one-process", "tp2", "pp2"])
def test_fsdp2_checkpoint_resumes_without_fsdp(nproc, layout, fsdp_dp2, one_process, shared_data, shakespeare_prefix,
                                               tmp_path):
    run = _run(nproc, layout, tmp_path, "resumed", shared_data, shakespeare_prefix, load=fsdp_dp2["ckpt"], save=False)
    _assert_same(run, one_process, range(SAVE_AT + 1, ITERS + 1), grad_norms=False)


def test_one_process_checkpoint_resumes_under_fsdp2(one_process, shared_data, shakespeare_prefix, tmp_path):
    run = _run(2, FSDP2, tmp_path, "resumed", shared_data, shakespeare_prefix, load=one_process["ckpt"], save=False)
    _assert_same(run, one_process, range(SAVE_AT + 1, ITERS + 1))


def test_fsdp2_bf16_trains_and_resumes_like_one_process(shared_data, shakespeare_prefix, tmp_path):
    """--bf16: bf16 shards, fp32 reduce-scatter, fp32 main copies of the shards (saved and restored):
    the losses of a one-process bf16 run within 1e-4 (reduction order moves bf16 roundings), and an
    FSDP2 bf16 checkpoint resumes in one process."""
    bf16 = ["--bf16"]
    reference = _run(1, bf16, tmp_path, "one_bf16", shared_data, shakespeare_prefix, save=False)
    run = _run(2, [*FSDP2, *bf16], tmp_path, "fsdp_bf16", shared_data, shakespeare_prefix)
    resumed = _run(1, bf16, tmp_path, "resumed_bf16", shared_data, shakespeare_prefix, load=run["ckpt"], save=False)
    for result, first in ((run, 1), (resumed, SAVE_AT + 1)):
        assert sorted(result["loss"]) == list(range(first, ITERS + 1))
        for iteration in range(first, ITERS + 1):
            assert result["loss"][iteration] == pytest.approx(reference["loss"][iteration], rel=1e-4), iteration


# ---- flag combinations ---------------------------------------------------------------------------

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--train-iters", "2", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"]
GOOD = [*FSDP2, "--untie-embeddings-and-output-weights", "--no-gradient-accumulation-fusion"]


def _validate(flags, monkeypatch, world_size=2):
    from megatron.training.arguments import parse_args, validate_args

    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", "0")
    return validate_args(parse_args(args=[*BASE, *flags]))


@pytest.mark.parametrize("extra,drop,expected", [
    (["--use-distributed-optimizer"], None,
     "--use-torch-fsdp2 and --use-distributed-optimizer are mutually exclusive"),
    (["--ckpt-format", "torch"], None, "--use-torch-fsdp2 requires --ckpt-format torch_dist (got torch)"),
    ([], "--untie-embeddings-and-output-weights", "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
    (["--fp16"], None, "--use-torch-fsdp2 is not supported with --fp16"),
    (["--pipeline-model-parallel-size", "2"], None, "--use-torch-fsdp2 is not supported with pipeline parallelism"),
    ([], "--no-gradient-accumulation-fusion", "--use-torch-fsdp2 requires --no-gradient-accumulation-fusion"),
], ids=["distributed-optimizer", "ckpt-format", "tied", "fp16", "pp2", "grad-accumulation-fusion"])
def test_conflicting_flags_are_refused_in_one_line(extra, drop, expected, monkeypatch):
    flags = [f for f in GOOD if f != drop] + extra
    with pytest.raises(ValueError) as error:
        _validate(flags, monkeypatch)
    message = str(error.value)
    assert message.startswith(expected) and "\n" not in message


def test_accepted_flags_build_the_fsdp2_config(monkeypatch):
    from megatron.core.distributed import TorchFullyShardedDataParallelConfig
    from megatron.training.argument_utils import ddp_config_from_args

    config = ddp_config_from_args(_validate([*GOOD, "--torch-fsdp2-no-reshard-after-forward", "--overlap-grad-reduce",
                                             "--overlap-param-gather"], monkeypatch))
    assert isinstance(config, TorchFullyShardedDataParallelConfig)
    assert config.reshard_after_forward is False and config.overlap_param_gather and config.overlap_grad_reduce
    assert type(ddp_config_from_args(_validate([], monkeypatch))).__name__ == "DistributedDataParallelConfig"


# ---- uneven shards in checkpoints ----------------------------------------------------------------

def _uneven_shards_worker(rank, world_size):
    """fully_shard a [5, 3] weight and a [2] bias over 3 ranks (rows 2, 2, 1 and 1, 1, 0): the sharded
    tensors of the checkpoint must tile each global tensor exactly once, as views of the live shards."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import TPLayout, sharded_tensors_of_local

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 5)
    module.bias = torch.nn.Parameter(torch.arange(2.0))
    full = {name: p.detach().clone() for name, p in module.named_parameters()}
    fully_shard(module, mesh=DeviceMesh.from_group(dist.group.WORLD, "cpu"))
    out = {}
    for name, param in module.named_parameters():
        layout = TPLayout(tuple(param.shape), None, 1, 0, 1)
        items = sharded_tensors_of_local(name, param.detach(), layout)
        for item in items:
            item.data.add_(0)  # a view: writable in place
            assert torch.equal(item.data, full[name][item.global_offset[0]:item.global_offset[0] + item.data.shape[0]])
        out[name] = [(item.global_offset, tuple(item.data.shape), item.global_shape) for item in items]
    return out


def test_uneven_fsdp2_shards_tile_the_global_tensors():
    from dist_utils import run_distributed

    results = run_distributed(_uneven_shards_worker, 3)
    assert [r["weight"] for r in results] == [[((0, 0), (2, 3), (5, 3))], [((2, 0), (2, 3), (5, 3))],
                                              [((4, 0), (1, 3), (5, 3))]]
    assert [r["bias"] for r in results] == [[((0,), (1,), (2,))], [((1,), (1,), (2,))], []]
