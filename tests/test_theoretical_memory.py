"""Theoretical memory report: exact per-rank parameter shapes (checked against GPTModel under TP/PP on the
fake backend), Megatron's bytes per parameter, and the printed line."""
import re

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

import pretrain_gpt
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.training import global_vars
from megatron.training.arguments import parse_args, validate_args
from megatron.training.theoretical_memory_usage import (
    NUM_BYTES_IN_MEGABYTE,
    activation_memory_per_layer,
    bytes_per_parameter,
    compute_activation_memory,
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
    match = re.fullmatch(r"Theoretical memory footprints: weight and optimizer=(\d+\.\d\d) MB, "
                         r"activation=(\d+\.\d\d) MB, total=(\d+\.\d\d) MB\n\n", out)
    assert match, out
    n = num_parameters_on_rank(args)
    assert float(match.group(1)) == pytest.approx(18 * n / NUM_BYTES_IN_MEGABYTE, abs=0.005)
    assert footprint.weight_and_optimizer_bytes == 18 * n
    assert (footprint.weight_bytes, footprint.gradient_bytes, footprint.optimizer_bytes) == (2 * n, 4 * n, 12 * n)
    assert float(match.group(2)) == pytest.approx(footprint.activation_bytes / NUM_BYTES_IN_MEGABYTE, abs=0.005)
    assert float(match.group(3)) == pytest.approx(float(match.group(1)) + float(match.group(2)), abs=0.011)


def test_report_activation_with_sequence_parallel_selective_is_megatrons(monkeypatch, capsys):
    args = make_args("--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                     "--recompute-granularity", "selective", world_size=2, monkeypatch=monkeypatch)
    capsys.readouterr()
    footprint = report_theoretical_memory(args, num_microbatches=1)
    out = capsys.readouterr().out
    match = re.fullmatch(r"Theoretical memory footprints: weight and optimizer=(\d+\.\d\d) MB, "
                         r"activation=(\d+\.\d\d) MB, total=(\d+\.\d\d) MB\n\n", out)
    assert match, out
    s, b, h, f, v = 32, 2, 64, 256, args.padded_vocab_size
    # Korthikanti et al. Table 2 (selective recompute, SP): s*b*h*(18 + 4f/h) per layer over TP, as
    # Megatron-LM prints it; the input ids (8sb) are whole on each TP rank, the embedding dropout mask
    # (sbh), the output layer's inputs (4sbh) and fp32 logits (4sbV) split over TP; the embedding output
    # (2sbh) stays whole because the first layer's shard is a view of it.
    expected = (4 * s * b * h * (18 + 4 * f / h) / 2 + 8 * s * b + s * b * h / 2 + 2 * s * b * h / 2
                + 4 * s * b * h / 2 + 4 * s * b * v / 2)
    assert footprint.activation_bytes == pytest.approx(expected)


# GPT-3 XL as the GPU kit runs it (bench/gpu_check.py mfu_model): bf16, dropout 0, flash attention.
GPT3_XL = ["--num-layers", "24", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", "2048",
           "--max-position-embeddings", "2048", "--micro-batch-size", "16", "--bf16", "--hidden-dropout", "0",
           "--attention-dropout", "0"]


def test_activation_of_the_kit_model_by_hand(monkeypatch):
    args = make_args(*GPT3_XL, monkeypatch=monkeypatch, vocab=50257)
    s, b, h, a, layers = 2048, 16, 2048, 16, 24
    assert args.padded_vocab_size == 50304
    sbh = s * b * h  # 67,108,864
    # Per layer: norm/qkv/fc1 inputs 4 x 2sbh, Q/K/V 6sbh, linear_proj input 2sbh, GeLU input and output
    # 2 x 8sbh = 32 sbh (the paper's 34 sbh less its two dropout masks), plus the fp32 log-sum-exp 4asb.
    per_layer = 32 * sbh + 4 * a * s * b
    assert per_layer == 2_149_580_800  # 2050.0 MiB
    output = 4 * sbh + 4 * s * b * 50304  # final norm and output layer inputs, fp32 logits
    assert compute_activation_memory(args, 2) == layers * per_layer + 8 * s * b + output == 58_452_082_688
    weights = compute_weight_and_optimizer_memory(args).weight_and_optimizer_bytes
    assert round(weights / 2 ** 30, 1) == 22.1 and round(58_452_082_688 / 2 ** 30, 1) == 54.4  # 76.5 GiB together
    # With dropout the masks come back (the paper's 34 sbh); the unfused kernel adds 5as^2b per layer
    # (softmax output, dropout mask, dropout output); selective recompute drops the attention core.
    dropout = make_args(*GPT3_XL, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", monkeypatch=monkeypatch)
    assert activation_memory_per_layer(dropout) == 34 * sbh + 4 * a * s * b
    unfused = make_args(*GPT3_XL, "--hidden-dropout", "0.1", "--attention-dropout", "0.1",
                        "--attention-backend", "unfused", monkeypatch=monkeypatch)
    assert activation_memory_per_layer(unfused) == 34 * sbh + 5 * a * s * s * b
    assert activation_memory_per_layer(unfused, recompute=True) == 34 * sbh
    # TP=2 without sequence parallelism: sbh(10 + 24/t + 5as/(ht)) (the paper's eq. 2).
    tp2 = make_args(*GPT3_XL, "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--attention-backend",
                    "unfused", "--tensor-model-parallel-size", "2", world_size=2, monkeypatch=monkeypatch)
    assert activation_memory_per_layer(tp2) == sbh * (10 + 24 / 2 + 5 * a * s / (h * 2))


def test_full_recompute_keeps_layer_inputs(monkeypatch):
    base = make_args(*GPT3_XL, monkeypatch=monkeypatch)
    full = make_args(*GPT3_XL, "--recompute-granularity", "full", "--recompute-method", "uniform",
                     "--recompute-num-layers", "1", monkeypatch=monkeypatch)
    s, b, h = 2048, 16, 2048
    layer = activation_memory_per_layer(base)
    outside = compute_activation_memory(base, 1) - 24 * layer
    # 24 checkpointed inputs (2sbh each) and one layer recomputed whole during the backward.
    assert compute_activation_memory(full, 1) == pytest.approx(outside + 24 * 2 * s * b * h + layer)


def _saved_activation_bytes(args):
    """Bytes autograd keeps from one forward (loss included) of the GPT model of ``args`` on this rank.

    Every tensor saved for the backward is counted once per storage; parameters are not activations.
    """
    global_vars.set_args(args)
    model = pretrain_gpt.model_provider()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    s, b = args.seq_length, args.micro_batch_size
    tokens = torch.randint(0, 1000, (b, s))
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens, positions, None, labels=tokens)
    return sum(storages.values())


@pytest.mark.parametrize("tp,flags", [(1, []), (2, []), (2, ["--sequence-parallel"]),
                                      (1, ["--recompute-granularity", "selective"])],
                         ids=["tp1", "tp2", "tp2-sp", "selective"])
def test_activation_estimate_matches_what_autograd_keeps(tp, flags, fake_world, monkeypatch):
    """The estimate against the bytes autograd holds after a real forward on the CPU (bf16, dropout 0,
    PyTorch's flash kernel; TP over the fake backend, which has the shapes of real collectives)."""
    args = make_args("--bf16", "--hidden-dropout", "0", "--attention-dropout", "0", "--seq-length", "128",
                     "--max-position-embeddings", "128", "--hidden-size", "128", "--num-layers", "2",
                     "--tensor-model-parallel-size", str(tp), *flags, world_size=tp, monkeypatch=monkeypatch)
    fake_world(tp, 0, tp=tp)
    measured = _saved_activation_bytes(args)
    estimate = compute_activation_memory(args, 1)
    # What the formula leaves out: the norms' mean and rstd (sb each) and position ids.
    assert abs(measured - estimate) <= 0.01 * measured, (measured, estimate)


def test_most_loaded_stage_is_reported(monkeypatch):
    args = make_args("--untie-embeddings-and-output-weights", world_size=2, monkeypatch=monkeypatch,
                     pipeline_model_parallel_size=2)
    counts = [num_parameters_on_rank(args, r) for r in range(2)]
    footprint = compute_weight_and_optimizer_memory(args)
    assert footprint.num_parameters_on_rank == max(counts)
    assert footprint.pp_rank == counts.index(max(counts))


def test_context_parallelism_divides_the_activations(monkeypatch):
    """Each CP rank holds s / CP tokens: every per-token term is divided by CP, and the unfused [s, s] term
    becomes the local queries against all keys."""
    flags = [*GPT3_XL, "--hidden-dropout", "0.1", "--attention-dropout", "0", "--attention-backend", "unfused"]
    one = make_args(*flags, monkeypatch=monkeypatch)
    cp2 = make_args(*flags, "--context-parallel-size", "2", world_size=2, monkeypatch=monkeypatch)
    assert activation_memory_per_layer(cp2) == activation_memory_per_layer(one) / 2
    assert compute_activation_memory(cp2, 2) == compute_activation_memory(one, 2) / 2
