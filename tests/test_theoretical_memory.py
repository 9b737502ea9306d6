"""Theoretical memory report: exact per-rank parameter shapes (checked against GPTModel under TP/PP on the
fake backend), Megatron's bytes per parameter, and the printed line."""
import re

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

import pretrain_gpt
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from megatron.training.theoretical_memory_usage import (
    NUM_BYTES_IN_MEGABYTE,
    bytes_per_parameter,
    compute_weight_and_optimizer_memory,
    gpt_parameter_shapes,
    num_parameters_in_model,
    num_parameters_on_rank,
    report_theoretical_memory,
)
from megatron.training.tokenizer import _vocab_size_with_padding

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3",
        "--use-cpu-initialization"]
LLAMA_LIKE = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
              "--group-query-attention", "--num-query-groups", "2", "--untie-embeddings-and-output-weights",
              "--disable-bias-linear"]


def make_args(*flags, world_size=1, monkeypatch=None, vocab=1000, **overrides):
    """Validated args for ``world_size`` ranks (PP and the distributed optimizer are set after
    validation: the formula does not need the features to exist)."""
    for name in ("RANK", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = validate_args(parse_args(args=[*BASE, *flags]))
    for key, value in overrides.items():
        setattr(args, key, value)
    if "pipeline_model_parallel_size" in overrides:
        args.data_parallel_size = world_size // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size)
    args.padded_vocab_size = _vocab_size_with_padding(vocab, args)
    return args


@pytest.fixture
def fake_world():
    """``start(world, rank, tp, pp)``: this process becomes one rank of a fake process group."""
    started = []

    def start(world, rank, tp=1, pp=1):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        started.append(True)
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        model_parallel_cuda_manual_seed(1234)

    yield start
    if started:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    global_vars.set_args(None)


def _model_shapes(args, pp_rank):
    global_vars.set_args(args)
    model = pretrain_gpt.model_provider(pre_process=pp_rank == 0,
                                        post_process=pp_rank == args.pipeline_model_parallel_size - 1)
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


@pytest.mark.parametrize("flags", [[], LLAMA_LIKE, ["--add-qkv-bias", "--disable-bias-linear", "--qk-layernorm"]],
                         ids=["gpt", "llama", "qkv-bias-qk-norm"])
@pytest.mark.parametrize("tp,pp,rank", [(1, 1, 0), (2, 1, 1), (2, 2, 1), (1, 2, 1)],
                         ids=["tp1", "tp2", "tp2pp2-first", "pp2-last"])
def test_shapes_match_gpt_model(flags, tp, pp, rank, fake_world, monkeypatch):
    world = tp * pp
    args = make_args(*flags, "--tensor-model-parallel-size", str(tp), world_size=world, monkeypatch=monkeypatch,
                     pipeline_model_parallel_size=pp)
    fake_world(world, rank, tp=tp, pp=pp)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    assert gpt_parameter_shapes(args, pp_rank) == _model_shapes(args, pp_rank)


@pytest.mark.parametrize("flags", [[], LLAMA_LIKE], ids=["tied", "llama-untied"])
def test_whole_model_count_matches_gpt_model(flags, fake_world, monkeypatch):
    args = make_args(*flags, monkeypatch=monkeypatch)
    fake_world(1, 0)
    model_params = sum(_numel(shape) for _, shape in _model_shapes(args, 0))
    assert num_parameters_in_model(args) == model_params == num_parameters_on_rank(args)


def _numel(shape):
    out = 1
    for size in shape:
        out *= size
    return out


def test_pipeline_split_and_uneven_stages(monkeypatch):
    args = make_args(world_size=4, monkeypatch=monkeypatch, pipeline_model_parallel_size=4, num_layers=10,
                     decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3)
    layers = [sum(name.endswith("input_layernorm.weight") for name, _ in gpt_parameter_shapes(args, r))
              for r in range(4)]
    assert layers == [1, 3, 3, 3]
    # The tied output weight is a copy on the last stage: the stages together hold one embedding more.
    total = sum(num_parameters_on_rank(args, r) for r in range(4))
    assert total == num_parameters_in_model(args) + args.padded_vocab_size * args.hidden_size


@pytest.mark.parametrize("dp", [1, 2, 8, 64, 512])
def test_bytes_per_parameter_follow_megatron(dp, monkeypatch):
    bf16 = make_args("--bf16", world_size=dp, monkeypatch=monkeypatch)
    assert bytes_per_parameter(bf16).total == 18  # 2 weight + 4 fp32 grad + 4 main + 8 Adam
    bf16.use_distributed_optimizer = True
    assert bytes_per_parameter(bf16).total == pytest.approx(6 + 12 / dp)
    fp32 = make_args(world_size=dp, monkeypatch=monkeypatch)
    assert bytes_per_parameter(fp32).total == 16  # no main copy: the optimizer updates the fp32 params
    fp32.use_distributed_optimizer = True
    assert bytes_per_parameter(fp32).total == pytest.approx(8 + 8 / dp)
    fp16 = make_args("--fp16", world_size=dp, monkeypatch=monkeypatch)
    assert bytes_per_parameter(fp16).total == 16  # fp16 grads unless --accumulate-allreduce-grads-in-fp32
    bf16_grads = make_args("--bf16", "--grad-reduce-in-bf16", world_size=dp, monkeypatch=monkeypatch)
    assert bytes_per_parameter(bf16_grads).gradient == 2
    sgd = make_args("--optimizer", "sgd", world_size=dp, monkeypatch=monkeypatch)
    assert bytes_per_parameter(sgd).optimizer_state == 4


def test_report_line_is_megatrons(monkeypatch, capsys):
    args = make_args("--bf16", world_size=2, monkeypatch=monkeypatch)
    capsys.readouterr()
    footprint = report_theoretical_memory(args, num_microbatches=1)
    out = capsys.readouterr().out
    match = re.fullmatch(r"Theoretical memory footprints: weight and optimizer=(\d+\.\d\d) MB\n", out)
    assert match, out
    n = num_parameters_on_rank(args)
    assert float(match.group(1)) == pytest.approx(18 * n / NUM_BYTES_IN_MEGABYTE, abs=0.005)
    assert footprint.weight_and_optimizer_bytes == 18 * n
    assert (footprint.weight_bytes, footprint.gradient_bytes, footprint.optimizer_bytes) == (2 * n, 4 * n, 12 * n)


def test_report_adds_activation_with_sequence_parallel_selective(monkeypatch, capsys):
    args = make_args("--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--recompute-granularity", "selective", world_size=2, monkeypatch=monkeypatch)
    capsys.readouterr()
    footprint = report_theoretical_memory(args, num_microbatches=1)
    out = capsys.readouterr().out
    match = re.fullmatch(r"Theoretical memory footprints: weight and optimizer=(\d+\.\d\d) MB, "
                         r"activation=(\d+\.\d\d) MB, total=(\d+\.\d\d) MB\n\n", out)
    assert match, out
    s, b, h, f, v = 32, 2, 64, 256, args.padded_vocab_size
    # Korthikanti et al. Table 2 (selective recompute, SP): s*b*h*(18 + 4f/h) per layer, over TP.
    expected = (4 * s * b * h * (18 + 4 * f / h) + 8 * s * b + s * b * h + 4 * s * b * h * (1 + v / h)) / 2
    assert footprint.activation_bytes == pytest.approx(expected)
    assert float(match.group(3)) == pytest.approx(float(match.group(1)) + float(match.group(2)), abs=0.011)


def test_most_loaded_stage_is_reported(monkeypatch):
    args = make_args("--untie-embeddings-and-output-weights", world_size=2, monkeypatch=monkeypatch,
                     pipeline_model_parallel_size=2)
    counts = [num_parameters_on_rank(args, r) for r in range(2)]
    footprint = compute_weight_and_optimizer_memory(args)
    assert footprint.num_parameters_on_rank == max(counts)
    assert footprint.pp_rank == counts.index(max(counts))
