"""Flags no other test exercised, each shown to reach what it controls (model, optimizer, loop, data, logs)."""
import importlib.util
import re
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

from dist_utils import run_distributed
from megatron.core import num_microbatches_calculator as nmc
from megatron.training import argument_utils, global_vars, training
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
from megatron.training.training_state import TrainingState
from pretrain_utils import REPO, run_pretrain, tensorboard_scalars

BASE = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--train-iters", "8", "--lr", "1e-3",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
ROPE = ["--position-embedding-type", "rope"]


@pytest.fixture(autouse=True)
def _clean_state(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    yield
    global_vars.set_args(None)
    nmc.destroy_num_microbatches_calculator()


def _args(*flags, base=BASE):
    return validate_args(parse_args(args=[*base, *flags]))


def _pretrain_gpt():
    spec = importlib.util.spec_from_file_location("pretrain_gpt", REPO / "pretrain_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _model(*flags):
    """pretrain_gpt's model provider on the given flags (seed 0, on the CPU), and its logits for fixed tokens."""
    args = _args("--use-cpu-initialization", *flags)
    args.padded_vocab_size = 64
    global_vars.set_args(args)
    torch.manual_seed(0)
    model = _pretrain_gpt().model_provider()
    tokens = (torch.arange(32).view(2, 16) * 7) % 64
    positions = torch.arange(16).unsqueeze(0).expand(2, 16)
    with torch.no_grad():
        logits = model(tokens, positions, None)
    return model, logits


# ---------------------------------------------------------------------------------------------------
# Model flags change the model
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("base,flags", [
    (ROPE, ["--rotary-base", "100"]),
    (ROPE, ["--rotary-percent", "0.5"]),
    (ROPE, ["--rotary-seq-len-interpolation-factor", "4"]),
    ([], ["--apply-residual-connection-post-layernorm"]),
    ([], ["--init-method-std", "0.2"]),
    ([], ["--embedding-init-method-std", "0.3"]),
])
def test_model_flag_changes_the_logits(base, flags):
    _, reference = _model(*base)
    _, changed = _model(*base, *flags)
    assert reference.shape == changed.shape
    assert not torch.allclose(reference, changed, atol=1e-4), f"{flags} did not change the model's output"


def test_rope_scaling_flags_change_the_rotary_angles():
    # Llama-3.1 scaling only touches wavelengths above 2048 positions: visible in the angles, not in
    # the logits of a 16-token sequence.
    models = [_model(*ROPE, *flags)[0] for flags in ([], ["--use-rope-scaling"],
                                                      ["--use-rope-scaling", "--rope-scaling-factor", "2"])]
    plain, scaled, factor2 = (m.rotary_pos_emb(16, device=torch.device("cpu")) for m in models)
    assert not torch.equal(plain, scaled) and not torch.equal(scaled, factor2)


def test_init_stds_reach_the_weights():
    model, _ = _model("--init-method-std", "0.2", "--embedding-init-method-std", "0.05")
    fc1 = model.decoder.layers[0].mlp.linear_fc1.weight
    assert fc1.std().item() == pytest.approx(0.2, rel=0.1)
    assert model.embedding.word_embeddings.weight.std().item() == pytest.approx(0.05, rel=0.1)


def test_kv_channels_and_qkv_bias_shape_the_attention():
    model, _ = _model("--kv-channels", "4")
    qkv = model.decoder.layers[0].self_attention.linear_qkv.weight
    assert qkv.shape == (3 * 4 * 4, 32)  # (q + k + v) x heads x kv_channels rows
    no_bias, _ = _model("--disable-bias-linear")
    qkv_bias, _ = _model("--disable-bias-linear", "--add-qkv-bias")
    assert "decoder.layers.0.self_attention.linear_qkv.bias" not in no_bias.state_dict()
    assert "decoder.layers.0.self_attention.linear_qkv.bias" in qkv_bias.state_dict()
    assert "decoder.layers.0.mlp.linear_fc1.bias" not in qkv_bias.state_dict()


def test_fp16_lm_cross_entropy_reaches_the_model():
    model, _ = _model("--fp16", "--fp16-lm-cross-entropy")
    assert model.fp16_lm_cross_entropy is True


@pytest.mark.parametrize("flags,field,value", [
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
     "recompute_num_layers", 1),
    (["--calculate-per-token-loss"], "calculate_per_token_loss", True),
    (["--swiglu", "--no-bias-swiglu-fusion"], "bias_activation_fusion", False),
    (["--use-cpu-initialization"], "use_cpu_initialization", True),
    (["--apply-query-key-layer-scaling"], "apply_query_key_layer_scaling", True),
    (["--apply-query-key-layer-scaling"], "attention_softmax_in_fp32", True),
    (["--attention-softmax-in-fp32"], "attention_softmax_in_fp32", True),
    (["--no-barrier-with-L1-time"], "barrier_with_L1_time", False),
    (["--no-overlap-p2p-communication"], "overlap_p2p_comm", False),
    (["--kv-channels", "4"], "kv_channels", 4),
    (["--embedding-init-method-std", "0.3"], "embedding_init_method_std", 0.3),
])
def test_flag_reaches_the_transformer_config(flags, field, value):
    config = core_transformer_config_from_args(_args(*flags))
    assert getattr(config, field) == value


# ---------------------------------------------------------------------------------------------------
# Optimizer and learning-rate schedule
# ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags,field,value", [
    (["--weight-decay", "0.2"], "weight_decay", 0.2),
    (["--clip-grad", "0.5"], "clip_grad", 0.5),
    (["--adam-beta1", "0.8"], "adam_beta1", 0.8),
    (["--adam-beta2", "0.95"], "adam_beta2", 0.95),
    (["--adam-eps", "1e-6"], "adam_eps", 1e-6),
    (["--optimizer", "sgd", "--sgd-momentum", "0.5"], "sgd_momentum", 0.5),
    (["--decoupled-lr", "1e-4"], "decoupled_lr", 1e-4),
    (["--decoupled-lr", "1e-4", "--decoupled-min-lr", "1e-5"], "decoupled_min_lr", 1e-5),
    (["--fp16", "--initial-loss-scale", "1024"], "initial_loss_scale", 1024),
    (["--fp16", "--min-loss-scale", "2"], "min_loss_scale", 2),
    (["--fp16", "--loss-scale-window", "10"], "loss_scale_window", 10),
    (["--fp16", "--hysteresis", "3"], "hysteresis", 3),
    (["--log-num-zeros-in-grad"], "log_num_zeros_in_grad", True),
])
def test_flag_reaches_the_optimizer_config(flags, field, value):
    assert getattr(argument_utils.optimizer_config_from_args(_args(*flags)), field) == value


class _Groups:
    def __init__(self):
        self.param_groups = [{"lr": 0.0, "weight_decay": 0.0}]


def test_schedule_flags_shape_the_learning_rate():
    # gbs 2: warm-up 2 iterations from 1e-4, WSD over 8 iterations with a linear 4-iteration anneal.
    args = _args("--lr-warmup-iters", "2", "--lr-warmup-init", "1e-4", "--lr-decay-style", "WSD",
                 "--lr-wsd-decay-style", "linear", "--lr-wsd-decay-iters", "4", "--min-lr", "0")
    global_vars.set_args(args)
    scheduler = training.get_optimizer_param_scheduler(_Groups())
    lrs = []
    for _ in range(9):
        lrs.append(scheduler.get_lr({}))
        scheduler.step(2)
    assert lrs == pytest.approx([1e-4, 5.5e-4, 1e-3, 1e-3, 1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0])
    samples = _args("--lr-decay-style", "WSD", "--lr-wsd-decay-samples", "6", "--lr-warmup-samples", "2",
                    base=[b for b in BASE if b not in ("--train-iters", "8")] + ["--train-samples", "16"])
    global_vars.set_args(samples)
    assert training.get_optimizer_param_scheduler(_Groups()).wsd_decay_steps == 6


@pytest.mark.parametrize("flag,attribute", [("--override-opt-param-scheduler", "override_opt_param_scheduler"),
                                            ("--use-checkpoint-opt-param-scheduler",
                                             "use_checkpoint_opt_param_scheduler")])
def test_checkpoint_schedule_choice_reaches_the_scheduler(flag, attribute):
    global_vars.set_args(_args(flag))
    assert getattr(training.get_optimizer_param_scheduler(_Groups()), attribute) is True


# ---------------------------------------------------------------------------------------------------
# Model wrapping, optimizer, seeds on real process groups
# ---------------------------------------------------------------------------------------------------

def _wrapped_model_worker(rank, world_size, flags, check_seed):
    from megatron.core import parallel_state
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.training import initialize

    parallel_state.initialize_model_parallel(1)
    args = validate_args(parse_args(args=[*BASE, *flags]))
    args.padded_vocab_size = 64
    global_vars.set_args(args)
    initialize._set_random_seed(args.seed, args.data_parallel_random_init)
    draw = torch.rand(3).tolist() if check_seed else None
    model = training.get_model(_pretrain_gpt().model_provider)
    ddp = model[0].ddp_config
    optimizer = get_megatron_optimizer(argument_utils.optimizer_config_from_args(args), model)
    group = optimizer.param_groups[0]
    return {"draw": draw, "grad_reduce_in_fp32": ddp.grad_reduce_in_fp32, "overlap": ddp.overlap_grad_reduce,
            "bucket": ddp.bucket_size, "average": ddp.average_in_collective, "betas": group["betas"],
            "eps": group["eps"]}


def test_ddp_optimizer_and_seed_flags_on_two_ranks():
    flags = ["--accumulate-allreduce-grads-in-fp32", "--overlap-grad-reduce", "--ddp-bucket-size", "1000",
             "--ddp-average-in-collective", "--adam-beta1", "0.8", "--adam-beta2", "0.95", "--adam-eps", "1e-6",
             "--data-parallel-random-init"]
    ranks = run_distributed(_wrapped_model_worker, 2, flags, True, timeout=240)
    for result in ranks:
        assert (result["grad_reduce_in_fp32"], result["overlap"], result["bucket"], result["average"]) == \
            (True, True, 1000, True)
        assert tuple(result["betas"]) == (0.8, 0.95) and result["eps"] == 1e-6
    # --data-parallel-random-init: the data-parallel ranks draw different random numbers.
    assert ranks[0]["draw"] != ranks[1]["draw"]
    same = run_distributed(_wrapped_model_worker, 2, [], True, timeout=240)
    assert same[0]["draw"] == same[1]["draw"]
    assert (same[0]["grad_reduce_in_fp32"], same[0]["overlap"], same[0]["average"]) == (False, False, False)


def test_distributed_timeout_reaches_the_process_group(monkeypatch):
    from megatron.core import parallel_state
    from megatron.training import initialize

    seen = {}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")  # restored afterwards
    monkeypatch.setenv("MASTER_PORT", "6000")
    monkeypatch.setattr(initialize.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(initialize.dist, "init_process_group", lambda **kwargs: seen.update(init=kwargs))
    monkeypatch.setattr(parallel_state, "model_parallel_is_initialized", lambda: False)
    monkeypatch.setattr(parallel_state, "initialize_model_parallel", lambda **kwargs: seen.update(groups=kwargs))
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_world_size", lambda: 1)
    cfg = pretrain_cfg_container_from_args(_args("--distributed-timeout-minutes", "3", "--distributed-backend", "gloo"))
    initialize._initialize_distributed(cfg.model, cfg.dist)
    assert seen["init"]["timeout"] == timedelta(minutes=3)
    assert seen["groups"]["distributed_timeout_minutes"] == 3


# ---------------------------------------------------------------------------------------------------
# The training loop: exit by duration, manual GC, freeing CUDA memory, evaluation micro batches
# ---------------------------------------------------------------------------------------------------

def test_exit_duration_stops_the_loop(monkeypatch, capsys):
    global_vars.set_args(_args("--exit-duration-in-mins", "1"))
    monkeypatch.setattr(training, "_TRAIN_START_TIME", training.time.time() - 30)
    assert training.checkpoint_and_decide_exit(None, None, None, 3, 0, None) is False
    monkeypatch.setattr(training, "_TRAIN_START_TIME", training.time.time() - 90)
    assert training.checkpoint_and_decide_exit(None, None, None, 4, 0, None) is True
    assert re.search(r"exiting program after 1\.\d\d minutes", capsys.readouterr().out)


class _FakeGC:
    def __init__(self):
        self.collects, self.enabled = 0, True

    def disable(self):
        self.enabled = False

    def collect(self):
        self.collects += 1


class _Chunk:
    def train(self):
        pass

    def zero_grad_buffer(self):
        pass


class _Optimizer(_Groups):
    def zero_grad(self):
        pass

    def step(self):
        return True, 1.0, None

    def get_loss_scale(self):
        return torch.tensor(1.0)


def _run_fake_loop(monkeypatch, *flags):
    """training.train() for --train-iters 4 with a stand-in step; returns the GC stand-in."""
    args = _args("--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1", *flags)
    args.do_valid, args.padded_vocab_size = True, 64
    global_vars.set_args(args)
    nmc.reconfigure_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size, 1)
    fake_gc = _FakeGC()
    monkeypatch.setattr(training, "gc", fake_gc)
    monkeypatch.setattr(training, "train_step", lambda *a: ({}, 0, None, None))
    monkeypatch.setattr(training, "training_log", lambda *a, **k: None)
    monkeypatch.setattr(training, "evaluate_and_print_results", lambda *a, **k: {})
    iteration, _, exited = training.train(None, [_Chunk()], _Optimizer(), None, None, None)
    assert (iteration, exited) == (4, False)
    return fake_gc


def test_manual_gc_collects_on_schedule(monkeypatch):
    # Start-up 1 + every 2 iterations (2, 4) + before and after each of the 2 evaluations.
    fake = _run_fake_loop(monkeypatch, "--manual-gc", "--manual-gc-interval", "2")
    assert (fake.enabled, fake.collects) == (False, 1 + 2 + 2 * 2)
    fake = _run_fake_loop(monkeypatch, "--manual-gc", "--manual-gc-interval", "2", "--no-manual-gc-eval")
    assert (fake.enabled, fake.collects) == (False, 1 + 2)
    assert _run_fake_loop(monkeypatch).collects == 0


class _Timers:
    def __call__(self, *args, **kwargs):
        return self

    def start(self, *args, **kwargs):
        pass

    def stop(self, *args, **kwargs):
        pass


@pytest.mark.parametrize("level,empties", [(0, 0), (1, 1), (2, 2)])
def test_empty_unused_memory_level_frees_the_cuda_cache(monkeypatch, level, empties):
    from megatron.core import parallel_state

    global_vars.set_args(_args("--empty-unused-memory-level", str(level)))
    nmc.init_num_microbatches_calculator(0, None, 2, 2, 1)
    calls = []
    monkeypatch.setattr(training, "get_timers", lambda: _Timers())
    monkeypatch.setattr(training, "get_forward_backward_func", lambda: lambda **kwargs: [])
    monkeypatch.setattr(parallel_state, "is_pipeline_last_stage", lambda *a, **k: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the flag only acts on CUDA
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(1))
    scheduler = SimpleNamespace(step=lambda increment: None)
    training.train_step(None, None, [_Chunk()], _Optimizer(), scheduler)
    assert len(calls) == empties


def test_eval_micro_batch_size_sets_the_evaluation_microbatches(monkeypatch):
    from megatron.core import parallel_state

    args = _args("--global-batch-size", "8", "--eval-micro-batch-size", "1", "--eval-iters", "2")
    global_vars.set_args(args)
    seen = []

    def forward_backward(**kwargs):
        seen.append((kwargs["num_microbatches"], kwargs["micro_batch_size"], kwargs["forward_only"]))
        return [{"lm loss": torch.tensor([2.0, 1.0])}]

    monkeypatch.setattr(training, "get_forward_backward_func", lambda: forward_backward)
    monkeypatch.setattr(parallel_state, "get_data_parallel_group", lambda **kwargs: None)
    state = TrainingState(consumed_valid_samples=4)
    assert training.evaluate(None, None, [torch.nn.Linear(1, 1)], train_state=state) == {"lm loss": 2.0}
    assert seen == [(8, 1, True), (8, 1, True)]
    assert state.consumed_valid_samples == 4 + 16


# ---------------------------------------------------------------------------------------------------
# Data and tokenizer flags
# ---------------------------------------------------------------------------------------------------

def test_data_flags_reach_the_dataset_config(monkeypatch):
    pretrain_gpt = _pretrain_gpt()
    from megatron.core.tokenizers import NullTokenizer

    monkeypatch.setattr(pretrain_gpt, "get_tokenizer", lambda: NullTokenizer(100))
    args = _args("--train-data-path", "tr", "--valid-data-path", "0.4", "va", "0.6", "vb", "--test-data-path", "te",
                 "--mid-level-dataset-surplus", "0.01", "--num-dataset-builder-threads", "2",
                 "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")
    config = pretrain_gpt.core_gpt_dataset_config_from_args(args)
    assert config.blend_per_split[1] == (["va", "vb"], [0.4, 0.6])
    assert config.blend_per_split[2] == (["te"], None)
    assert (config.mid_level_dataset_surplus, config.num_dataset_builder_threads) == (0.01, 2)
    assert config.reset_position_ids and config.reset_attention_mask and config.eod_mask_loss


def test_tokenizer_flags_reach_the_tokenizer(shared_data):
    from megatron.training.tokenizer import build_tokenizer

    args = _args("--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--padded-vocab-size", "1000",
                 "--null-tokenizer-pad-id", "7")
    tokenizer = build_tokenizer(args)
    assert args.padded_vocab_size == 1000 and tokenizer.pad == 7
    model = str(shared_data / "shakespeare-sp8k.model")
    plain = build_tokenizer(_args("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model))
    extra = build_tokenizer(_args("--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                                  "--vocab-extra-ids", "3"))
    assert extra.vocab_size == plain.vocab_size + 3


# ---------------------------------------------------------------------------------------------------
# Batch size, deprecated no-ops
# ---------------------------------------------------------------------------------------------------

def test_decrease_batch_size_if_needed_rounds_down(capsys):
    args = _args("--micro-batch-size", "4", "--global-batch-size", "10", "--decrease-batch-size-if-needed")
    assert args.global_batch_size == 8
    assert "decreasing global batch size from 10 to 8 (--decrease-batch-size-if-needed)" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"global batch size \(10\) is not divisible"):
        _args("--micro-batch-size", "4", "--global-batch-size", "10")


@pytest.mark.parametrize("flags,warning", [
    (["--use-mcore-models"], "--use-mcore-models is deprecated and has no effect"),
    (["--use-dist-ckpt"], "--use-dist-ckpt and --dist-ckpt-format are deprecated and ignored"),
    (["--dist-ckpt-format", "torch_dist"], "--use-dist-ckpt and --dist-ckpt-format are deprecated and ignored"),
])
def test_deprecated_megatron_no_ops_warn_and_change_nothing(capsys, flags, warning):
    def settings(args):
        config = core_transformer_config_from_args(args)
        plain_fields = {k: v for k, v in vars(config).items() if not callable(v)}
        return plain_fields, argument_utils.optimizer_config_from_args(args)

    plain_args = _args()
    plain = settings(plain_args)
    capsys.readouterr()
    args = _args(*flags)
    assert warning in capsys.readouterr().out
    assert settings(args) == plain
    # use_dist_ckpt follows --ckpt-format (default torch_dist), whatever the deprecated flags say.
    assert args.use_dist_ckpt is plain_args.use_dist_ckpt is True


@pytest.mark.parametrize("flag", ["--no-scatter-gather-tensors-in-pipeline", "--cross-entropy-loss-fusion"])
def test_megatron_flags_without_effect_here_are_accepted_and_change_nothing(capsys, flag):
    # Megatron-LM's example scripts pass them; core_v0.14 ignores the first one itself, and the second
    # only picks a fused kernel for the same loss (this project has one cross entropy).
    def settings(args):
        config = core_transformer_config_from_args(args)
        plain_fields = {k: v for k, v in vars(config).items() if not callable(v)}
        return plain_fields, argument_utils.optimizer_config_from_args(args)

    plain = settings(_args("--pipeline-model-parallel-size", "1"))
    args = _args("--pipeline-model-parallel-size", "1", flag)
    assert settings(args) == plain
    assert (args.scatter_gather_tensors_in_pipeline, args.cross_entropy_loss_fusion) == \
        ((False, False) if flag == "--no-scatter-gather-tensors-in-pipeline" else (True, True))


def test_tensorboard_queue_size_reaches_the_writer(monkeypatch, tmp_path):
    import torch.utils.tensorboard

    created = {}

    class _Writer:
        def __init__(self, **kwargs):
            created.update(kwargs)

        def add_text(self, *args):
            pass

    monkeypatch.setattr(torch.utils.tensorboard, "SummaryWriter", _Writer)
    monkeypatch.setattr(global_vars, "_GLOBAL_TENSORBOARD_WRITER", None)
    args = _args("--tensorboard-dir", str(tmp_path), "--tensorboard-queue-size", "7")
    cfg = pretrain_cfg_container_from_args(args)
    global_vars._set_tensorboard_writer(cfg.logger, cfg.dist, vars(args))
    assert created == {"log_dir": str(tmp_path), "max_queue": 7}


# ---------------------------------------------------------------------------------------------------
# The log line and TensorBoard, end to end
# ---------------------------------------------------------------------------------------------------

def test_logging_flags_end_to_end(shared_data, shakespeare_prefix, tmp_path):
    tb = tmp_path / "tb"
    out = run_pretrain(1, ["--micro-batch-size", "4", "--train-iters", "4", "--log-params-norm",
                           "--log-num-zeros-in-grad", "--log-throughput", "--timing-log-level", "1",
                           "--timing-log-option", "max", "--no-barrier-with-L1-time", "--tensorboard-dir", str(tb),
                           "--tensorboard-log-interval", "2", "--log-world-size-to-tensorboard",
                           "--log-memory-to-tensorboard"], shared_data, shakespeare_prefix, tmp_path)
    lines = [line for line in out.splitlines() if "elapsed time per iteration" in line]
    assert len(lines) == 4
    for line in lines:
        assert re.search(r"\| throughput per GPU \(TFLOP/s/GPU\): [0-9.]+ \|", line)
        assert re.search(r"\| num zeros: \d+ \|", line) and re.search(r"\| params norm: [0-9.]+ \|", line)
    assert "max time across ranks (ms):" in out and "(min, max) time across ranks" not in out
    assert sorted(tensorboard_scalars(tb, "lm loss")) == [2, 4]
    assert tensorboard_scalars(tb, "world-size") == {2: 1.0, 4: 1.0}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    # CUDA memory statistics are written only on GPUs (as in Megatron-LM).
    assert torch.cuda.is_available() or "mem-allocated-bytes" not in events.Tags()["scalars"]
    assert {"params-norm", "num-zeros"} <= set(events.Tags()["scalars"])
