"""Legacy ``model_optim_rng.pt`` checkpoints moved between Megatron-LM core_v0.14.0 and this project, both ways.

The Megatron side is tests/data/mcore_v014 (written by the real megatron-core 0.14.0, see its README):
its logits, parameter order and Adam moments are the reference. The reverse direction (our checkpoint
loaded by Megatron's own optimizer and model) runs the real megatron-core in a subprocess when
MCORE_V014_PATH names an unpacked megatron-core 0.14.0 wheel, and is skipped otherwise.
"""
import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed
from pretrain_utils import REPO, run_pretrain

DATA = Path(__file__).resolve().parent / "data" / "mcore_v014"
LEGACY = DATA / "torch"
LEGACY_FILE = LEGACY / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
REFERENCE = DATA / "reference.pt"

# The pretrain_gpt.py flags of the fixture's writer (tests/data/mcore_v014/generate.py).
MODEL_FLAGS = [
    "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--micro-batch-size", "4", "--global-batch-size", "4",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
    "--train-iters", "10", "--weight-decay", "0.1", "--clip-grad", "0", "--seed", "1234", "--ckpt-format", "torch",
]


def _load_reference():
    return torch.load(REFERENCE, weights_only=True)


def _setup(load_dir, extra=()):
    """Model chunks, optimizer and scheduler of pretrain_gpt.py for MODEL_FLAGS, loaded from ``load_dir``."""
    import pretrain_gpt
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training import global_vars
    from megatron.training.arguments import parse_args, validate_args
    from megatron.training.tokenizer import _vocab_size_with_padding
    from megatron.training.training import setup_model_and_optimizer
    from megatron.training.training_state import TrainingState

    args = validate_args(parse_args(args=[*MODEL_FLAGS, "--load", str(load_dir), *extra]))
    args.padded_vocab_size = _vocab_size_with_padding(1001, args)  # NullTokenizer: --vocab-size + EOD
    global_vars.set_global_variables(args, build_tokenizer=False)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234)
    state = TrainingState()
    model, optimizer, scheduler = setup_model_and_optimizer(pretrain_gpt.model_provider, train_state=state)
    return args, model, optimizer, scheduler, state


def _teardown():
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.training import global_vars

    global_vars.destroy_global_variables()
    destroy_num_microbatches_calculator()
    parallel_state.destroy_model_parallel()


def _logits(model, reference):
    tokens, positions = reference["input_ids"], reference["position_ids"]
    seq = tokens.shape[1]
    mask = torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq) < 0.5  # True = masked, as Megatron's
    chunk = model[0]
    chunk.eval()
    with torch.no_grad():
        return chunk(tokens, positions, mask).float()


def _moment_norms(model, optimizer):
    """Per param name: (param norm, exp_avg norm, exp_avg_sq norm) of the optimizer's state for it."""
    inner = optimizer.optimizer
    norms = {}
    for name, param in model[0].module.named_parameters():
        state = inner.state[param]
        norms[name] = (param.detach().double().norm().item(), state["exp_avg"].double().norm().item(),
                       state["exp_avg_sq"].double().norm().item())
    return norms


def _check_against_reference(model, optimizer, reference):
    """Logits within 1e-5 of the writer's; every Adam moment on the param the writer had it on."""
    logits = _logits(model, reference)
    assert logits.shape == reference["logits"].shape
    assert (logits - reference["logits"]).abs().max().item() < 1e-5
    names = [name for name, _ in model[0].module.named_parameters()]
    assert names == reference["param_names"]  # Megatron's parameter order
    norms = _moment_norms(model, optimizer)
    for i, name in enumerate(reference["param_names"]):
        expected = (reference["param_norm"][i].item(), reference["exp_avg_norm"][i].item(),
                    reference["exp_avg_sq_norm"][i].item())
        assert norms[name] == pytest.approx(expected, rel=1e-6, abs=1e-12), name


def _load_megatron_fixture(rank, world):
    reference = _load_reference()
    try:
        args, model, optimizer, scheduler, state = _setup(LEGACY)
        _check_against_reference(model, optimizer, reference)
        groups = [sorted(names) for names in optimizer.param_names_by_group()]
        assert groups == [sorted(g["names"]) for g in reference["param_groups"]]
        assert [(g["wd_mult"], g["lr_mult"]) for g in optimizer.param_groups] == [
            (g["wd_mult"], g["lr_mult"]) for g in reference["param_groups"]]
        assert state.iteration == 3 and state.consumed_train_samples == 12
        assert scheduler.num_steps == 12
        return True
    finally:
        _teardown()


@pytest.mark.timeout(120)
def test_megatron_legacy_checkpoint_loads_logits_and_moments():
    """Megatron-written model_optim_rng.pt (AttnBackend enum in args, no ckpt_format key): logits equal to
    the writer's within 1e-5, each Adam moment on its param, counters and scheduler restored."""
    assert run_distributed(_load_megatron_fixture, 1) == [True]


def _permuted_copy(src_file, dst_dir, named):
    """The fixture with its parameter order changed as our older writer had it (linear_qkv before
    linear_proj in every layer): model keys and optimizer positions permuted consistently.
    ``named``: also give every optimizer group torch's ``param_names``."""
    from megatron.training.checkpointing import load_state_dict_file

    state = load_state_dict_file(src_file)
    model_keys = list(state["model"])

    def layer_order(key):
        # swap each layer's linear_proj block and linear_qkv block
        if ".self_attention.linear_qkv." in key:
            return key.replace("linear_qkv", "linear_proj")
        if ".self_attention.linear_proj." in key:
            return key.replace("linear_proj", "linear_qkv")
        return key

    positions = {key: i for i, key in enumerate(model_keys)}
    new_model_keys = sorted(model_keys, key=lambda k: positions[layer_order(k)])
    state["model"] = {key: state["model"][key] for key in new_model_keys}
    reference = _load_reference()
    optimizer = state["optimizer"]
    old_names = [n for g in reference["param_groups"] for n in g["names"]]  # writer's positions
    groups, new_state, position = [], {}, 0
    for group, ref_group in zip(optimizer["param_groups"], reference["param_groups"]):
        names = sorted(ref_group["names"], key=new_model_keys.index)  # the permuted writer's discovery order
        params = []
        for name in names:
            new_state[position] = optimizer["state"][old_names.index(name)]
            params.append(position)
            position += 1
        group = dict(group, params=params)
        if named:
            group["param_names"] = names
        groups.append(group)
    state["optimizer"] = {"state": new_state, "param_groups": groups}
    out = Path(dst_dir) / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    out.parent.mkdir(parents=True)
    torch.save(state, out)
    (Path(dst_dir) / "latest_checkpointed_iteration.txt").write_text("3")
    return state


def _load_permuted(rank, world, load_dir):
    reference = _load_reference()
    try:
        _, model, optimizer, _, _ = _setup(load_dir)
        _check_against_reference(model, optimizer, reference)
        return True
    finally:
        _teardown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("named", [False, True], ids=["megatron-positional", "param_names"])
def test_legacy_optimizer_state_is_mapped_by_name_when_order_differs(tmp_path, named):
    """A checkpoint whose writer ordered linear_qkv before linear_proj: each Adam moment still lands on
    its own param (by the checkpoint's model order, or by torch's per-group param_names)."""
    state = _permuted_copy(LEGACY_FILE, tmp_path, named)
    positions = [n for n in state["model"] if n.endswith((".weight", ".bias"))]
    assert positions != _load_reference()["param_names"]  # the order really differs
    assert run_distributed(_load_permuted, 1, tmp_path) == [True]
