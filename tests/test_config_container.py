"""PretrainConfigContainer: built once from the README tour's flags, JSON-able, every flag accounted for, kw_only."""
import argparse
import dataclasses
import json
import signal
from pathlib import Path

import pytest
import torch

from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.telemetry.config import TelemetryConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training import config as config_package
from megatron.training import global_vars
from megatron.training.argument_utils import (
    ARGUMENTS_ONLY_FLAGS,
    RENAMED_FLAGS,
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import add_megatron_arguments, parse_args, validate_args
from megatron.training.config import PretrainConfigContainer

REPO = Path(__file__).resolve().parent.parent

# The README tour's training flags (step 2), with the data and tokenizer files it names.
TOUR = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
        "--micro-batch-size 4 --global-batch-size 8 --lr 2e-3 --min-lr 2e-4 --lr-decay-style cosine "
        "--lr-warmup-iters 20 --train-iters 200 --data-path runs/tour/pydocs_text_document --split 98,2,0 "
        "--tokenizer-type SentencePieceTokenizer --tokenizer-model runs/tour/data/pydocs_sp.model "
        "--save runs/tour/ckpt --save-interval 200 "
        "--log-interval 20 --eval-interval 100 --eval-iters 5 --tensorboard-dir runs/tour/tensorboard").split()


def _tour_args(monkeypatch, world_size=2, rank=0):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    monkeypatch.setenv("RANK", str(rank))
    for name in ("MEGATRON_OTEL_ENABLED", "NEMO_LENS_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    args = validate_args(parse_args(args=TOUR))
    args.padded_vocab_size = 4096  # what build_tokenizer sets for the tour's 4,000-piece model at tp 1
    return args


def test_readme_tour_builds_the_expected_slices(monkeypatch):
    cfg = pretrain_cfg_container_from_args(_tour_args(monkeypatch))
    assert isinstance(cfg.model, TransformerConfig) and isinstance(cfg.optimizer, OptimizerConfig)
    assert isinstance(cfg.ddp, DistributedDataParallelConfig) and isinstance(cfg.telemetry, TelemetryConfig)
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_attention_heads) == (2, 128, 4)
    assert cfg.model.ffn_hidden_size == 512 and cfg.model.kv_channels == 32  # derived by validate_args
    assert cfg.model.params_dtype == torch.float and cfg.optimizer.params_dtype == torch.float
    assert (cfg.train.micro_batch_size, cfg.train.global_batch_size, cfg.train.train_iters) == (4, 8, 200)
    assert cfg.train.exit_signal == signal.SIGTERM
    assert (cfg.validation.eval_interval, cfg.validation.eval_iters) == (100, 5)
    assert (cfg.validation.eval_micro_batch_size, cfg.validation.eval_global_batch_size) == (4, 8)
    assert (cfg.optimizer.lr, cfg.optimizer.min_lr, cfg.optimizer.weight_decay) == (2e-3, 2e-4, 0.01)
    assert cfg.scheduler.lr_decay_style == "cosine"
    # Derived once, in samples, as get_optimizer_param_scheduler computes them.
    assert cfg.scheduler.lr_decay_iters == 200
    assert (cfg.scheduler.lr_decay_steps, cfg.scheduler.lr_warmup_steps, cfg.scheduler.wd_incr_steps) == \
        (1600, 160, 1600)
    assert (cfg.scheduler.start_weight_decay, cfg.scheduler.end_weight_decay) == (0.01, 0.01)
    assert (cfg.dist.world_size, cfg.dist.rank, cfg.dist.data_parallel_size) == (2, 0, 2)
    assert cfg.rng.seed == 1234
    assert (cfg.logger.log_interval, cfg.logger.tensorboard_dir) == (20, "runs/tour/tensorboard")
    assert (cfg.checkpoint.save, cfg.checkpoint.save_interval, cfg.checkpoint.ckpt_format) == \
        ("runs/tour/ckpt", 200, "torch_dist")
    assert cfg.checkpoint.save_optim and cfg.checkpoint.load_rng and cfg.checkpoint.verify_checkpoint
    assert (cfg.tokenizer.tokenizer_type, cfg.tokenizer.padded_vocab_size) == ("SentencePieceTokenizer", 4096)
    assert (cfg.data.data_path, cfg.data.split, cfg.data.seq_length) == \
        (["runs/tour/pydocs_text_document"], "98,2,0", 128)
    assert cfg.data.dataloader_type == "single"
    assert cfg.gpt.max_position_embeddings == 128 and cfg.gpt.position_embedding_type == "learned_absolute"
    assert cfg.ddp.check_for_nan_in_grad and not cfg.ddp.use_distributed_optimizer
    assert not cfg.telemetry.enabled
    assert not cfg.model.deterministic_mode and cfg.checkpoint.dist_ckpt_strictness == "assume_ok_unexpected"


def test_megatron_determinism_and_strictness_flags_reach_their_slices(monkeypatch):
    """--deterministic-mode -> model (Megatron's ModelParallelConfig field), --dist-ckpt-strictness -> checkpoint."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    args = validate_args(parse_args(args=[*TOUR, "--deterministic-mode", "--dist-ckpt-strictness", "raise_all"]))
    args.padded_vocab_size = 4096
    cfg = pretrain_cfg_container_from_args(args)
    assert cfg.model.deterministic_mode and cfg.checkpoint.dist_ckpt_strictness == "raise_all"


def test_model_slice_is_core_transformer_config_from_args(monkeypatch):
    args = _tour_args(monkeypatch)
    built, direct = pretrain_cfg_container_from_args(args).model, core_transformer_config_from_args(args)
    for field in dataclasses.fields(TransformerConfig):
        # The init methods are fresh functools.partial objects each time: equal by their text.
        mine, theirs = getattr(built, field.name), getattr(direct, field.name)
        assert mine == theirs or repr(mine) == repr(theirs), field.name


def test_builder_writes_nothing_to_args(monkeypatch):
    args = _tour_args(monkeypatch)
    before = dict(vars(args))
    pretrain_cfg_container_from_args(args)
    assert vars(args) == before


def test_to_dict_is_json(monkeypatch):
    cfg = pretrain_cfg_container_from_args(_tour_args(monkeypatch))
    data = cfg.to_dict()
    assert set(data) == {f.name for f in dataclasses.fields(PretrainConfigContainer)}
    text = json.dumps(data)
    assert json.loads(text)["train"]["global_batch_size"] == 8
    assert data["model"]["params_dtype"] == "torch.float32"
    assert data["train"]["exit_signal"] == "SIGTERM"


def _slices():
    """{slice name: its dataclass} of the container (core configs included)."""
    return {f.name: f.type for f in dataclasses.fields(PretrainConfigContainer)}


def _homes_by_name():
    """{field name: [slice, ...]} over every init field of every slice."""
    homes = {}
    for name, cls in _slices().items():
        for field in dataclasses.fields(cls):
            if field.init:
                homes.setdefault(field.name, []).append(name)
    return homes


# Settings that Megatron's core configs themselves repeat (the builder sets each copy from one flag).
CORE_SHARED = {"fp16": {"model", "optimizer"}, "bf16": {"model", "optimizer"},
               "use_distributed_optimizer": {"optimizer", "ddp"}}


def test_every_parser_flag_has_exactly_one_home():
    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    dests = {action.dest for action in parser._actions if not isinstance(action, argparse._HelpAction)}
    homes = _homes_by_name()
    problems = []
    for dest in sorted(dests):
        named = set(homes.get(dest, []))
        listed = [kind for kind, table in (("renamed", RENAMED_FLAGS), ("arguments-only", ARGUMENTS_ONLY_FLAGS))
                  if dest in table]
        if named and listed:
            problems.append(f"{dest}: a field of {sorted(named)} and also in {listed}")
        elif len(listed) > 1:
            problems.append(f"{dest}: in both RENAMED_FLAGS and ARGUMENTS_ONLY_FLAGS")
        elif not named and not listed:
            problems.append(f"{dest}: no config field, not in RENAMED_FLAGS nor ARGUMENTS_ONLY_FLAGS")
        elif len(named) > 1 and named != CORE_SHARED.get(dest):
            problems.append(f"{dest}: a field of several configs {sorted(named)}")
    for dest, target in RENAMED_FLAGS.items():
        slice_name, field_name = target.split(".")
        cls = _slices()[slice_name]
        if field_name not in {f.name for f in dataclasses.fields(cls)}:
            problems.append(f"RENAMED_FLAGS[{dest!r}] = {target!r}: no such field")
        if dest not in dests:
            problems.append(f"RENAMED_FLAGS[{dest!r}]: no such flag")
    problems += [f"ARGUMENTS_ONLY_FLAGS[{dest!r}]: no such flag" for dest in ARGUMENTS_ONLY_FLAGS if dest not in dests]
    assert not problems, "\n".join(problems)


def test_training_config_fields_have_one_home():
    """A field of the training/config records is not repeated in another slice (one home per setting)."""
    ours = [name for name, cls in _slices().items() if cls.__module__.startswith("megatron.training.config")]
    homes = _homes_by_name()
    doubled = {field: where for field, where in homes.items() if len(where) > 1 and set(where) & set(ours)}
    assert not doubled


@pytest.mark.parametrize("name", config_package.__all__)
def test_configs_are_keyword_only(name):
    cls = getattr(config_package, name)
    assert all(f.kw_only for f in dataclasses.fields(cls))
    with pytest.raises(TypeError, match="positional"):
        cls(None)


def test_get_config_is_built_once_and_forgotten_with_new_args(monkeypatch):
    previous = global_vars._GLOBAL_ARGS
    try:
        args = _tour_args(monkeypatch)
        global_vars.set_args(args)
        cfg = global_vars.get_config()
        assert global_vars.get_config() is cfg
        args2 = _tour_args(monkeypatch)
        args2.eval_iters = 7
        global_vars.set_args(args2)
        assert global_vars.get_config() is not cfg and global_vars.get_config().validation.eval_iters == 7
        global_vars.set_config(cfg)
        assert global_vars.get_config() is cfg
    finally:
        global_vars.set_args(previous)


def test_rules_live_in_validate_not_in_construction(tmp_path):
    """A config holding a bad value builds (library callers and tools build them freely); its validate()
    refuses it with the flag's message, the one validate_args prints."""
    from megatron.training.config import CheckpointConfig, DataConfig, RNGConfig, TokenizerConfig

    bad = CheckpointConfig(save=str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="^--save requires --save-interval$"):
        bad.validate()
    with pytest.raises(ValueError, match="^--seed must be > 0, got 0$"):
        RNGConfig(seed=0).validate()
    with pytest.raises(ValueError, match="^a single data source must be given, got --data-path and --mock-data$"):
        DataConfig(data_path=["x"], mock_data=True).validate()
    with pytest.raises(ValueError, match="--trust-remote-code applies only to --tokenizer-type HuggingFaceTokenizer"):
        TokenizerConfig(tokenizer_type="NullTokenizer", trust_remote_code=True).validate()
    with pytest.raises(ValueError, match="^--save requires --save-interval$"):
        validate_args(parse_args(args=["--num-layers", "2", "--hidden-size", "8", "--num-attention-heads", "2",
                                       "--seq-length", "8", "--max-position-embeddings", "8",
                                       "--micro-batch-size", "1", "--train-iters", "1", "--lr", "1e-3",
                                       "--save", str(tmp_path / "ckpt")]))


def test_core_reads_no_args():
    """megatron/core takes typed configs: no get_args(), getattr(args, ...) or args.<name> in its text."""
    import re

    pattern = re.compile(r"get_args\(|getattr\(args|args\.[a-z_]")
    hits = [f"{path.relative_to(REPO)}:{number}: {line.strip()}"
            for path in sorted((REPO / "megatron" / "core").rglob("*.py"))
            for number, line in enumerate(path.read_text().splitlines(), start=1) if pattern.search(line)]
    assert not hits, "\n".join(hits)
