"""Legacy ``model_optim_rng.pt`` checkpoints moved between Megatron-LM core_v0.14.0 and this project, both ways.

The Megatron side is tests/data/mcore_v014 (written by the real megatron-core 0.14.0, see its README):
its logits, parameter order and Adam moments are the reference. The reverse direction (our checkpoint
loaded by Megatron's own optimizer and model) runs the real megatron-core in a subprocess when
MCORE_V014_PATH names an unpacked megatron-core 0.14.0 wheel, and is skipped otherwise.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_distributed

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
    groups, new_state, position, new_names = [], {}, 0, []
    for group, ref_group in zip(optimizer["param_groups"], reference["param_groups"]):
        names = sorted(ref_group["names"], key=new_model_keys.index)  # the permuted writer's discovery order
        params = []
        new_names += names
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
    return state, sum(a != b for a, b in zip(old_names, new_names))  # moments now at another position


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
    state, moved = _permuted_copy(LEGACY_FILE, tmp_path, named)
    positions = [n for n in state["model"] if n.endswith((".weight", ".bias"))]
    assert positions != _load_reference()["param_names"]  # the order really differs
    assert moved == 8  # 8 of the 28 moments sit at another param's position (issue 21's case)
    assert run_distributed(_load_permuted, 1, tmp_path) == [True]


def _save_after_loading(rank, world, load_dir, save_dir):
    """Load ``load_dir``, save it again with our legacy writer (nothing trained in between)."""
    from megatron.training.checkpointing import save_checkpoint

    try:
        args, model, optimizer, scheduler, state = _setup(load_dir, ["--save", str(save_dir), "--save-interval", "3"])
        save_checkpoint(state.iteration, model, optimizer, scheduler, state.num_floating_point_operations_so_far,
                        train_state=state)
        return True
    finally:
        _teardown()


def _assert_same_structure(ours, theirs):
    """Our legacy dict against Megatron's: keys, model names/order/shapes/values, optimizer layout
    (positions, group identities, per-position state) and the args Megatron's loader reads."""
    assert list(ours) == list(theirs)
    assert list(ours["model"]) == list(theirs["model"])
    for key, value in theirs["model"].items():
        if torch.is_tensor(value):
            assert torch.equal(ours["model"][key], value), key
        else:
            assert ours["model"][key] is None and value is None, key  # linear layers' _extra_state
    mine, megatron = ours["optimizer"], theirs["optimizer"]
    assert list(mine) == list(megatron) == ["state", "param_groups"]
    assert len(mine["param_groups"]) == len(megatron["param_groups"])
    for g_ours, g_theirs in zip(mine["param_groups"], megatron["param_groups"]):
        assert g_ours["params"] == g_theirs["params"]
        # every key Megatron writes, with its value (hyper-parameters restored from the checkpoint)
        assert {k: g_ours[k] for k in g_theirs if k != "params"} == {k: v for k, v in g_theirs.items() if k != "params"}
        assert set(g_ours) - set(g_theirs) <= {"param_names", "default_config"}  # torch's optional names
    assert list(mine["state"]) == list(megatron["state"])
    for position, entry in megatron["state"].items():
        assert list(mine["state"][position]) == list(entry)
        for key, value in entry.items():
            assert torch.equal(mine["state"][position][key], value), (position, key)
    assert ours["opt_param_scheduler"] == theirs["opt_param_scheduler"]
    assert ours["checkpoint_version"] == theirs["checkpoint_version"] == 3.0
    assert ours["iteration"] == theirs["iteration"]
    assert isinstance(ours["rng_state"], list) and len(ours["rng_state"]) == 1
    # cuda_rng_state exists only where CUDA does (the fixture's is an empty CPU stand-in)
    assert set(theirs["rng_state"][0]) - set(ours["rng_state"][0]) <= {"cuda_rng_state"}
    for name in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings", "seq_length",
                 "padded_vocab_size", "make_vocab_size_divisible_by", "tokenizer_type", "tensor_model_parallel_size",
                 "pipeline_model_parallel_size", "consumed_train_samples", "attention_backend", "ckpt_format",
                 "params_dtype", "normalization", "position_embedding_type", "untie_embeddings_and_output_weights"):
        assert getattr(ours["args"], name) == getattr(theirs["args"], name), name
    assert type(ours["args"].attention_backend).__qualname__ == "AttnBackend"
    assert "ckpt_format" not in ours


@pytest.mark.timeout(120)
def test_our_legacy_checkpoint_has_megatrons_layout(tmp_path):
    """Load the Megatron file, save it with our writer: the same keys, names, order, shapes and values,
    so Megatron-LM's loader finds everything where it writes it."""
    from megatron.training.checkpointing import load_state_dict_file

    assert run_distributed(_save_after_loading, 1, LEGACY, tmp_path / "ours") == [True]
    assert (tmp_path / "ours" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    ours = load_state_dict_file(tmp_path / "ours" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    _assert_same_structure(ours, load_state_dict_file(LEGACY_FILE))


@pytest.mark.timeout(180)
def test_training_continues_from_the_megatron_checkpoint(tmp_path):
    """pretrain_gpt.py --load on the Megatron fixture (same model flags, mock data) trains on from iteration 3."""
    from pretrain_utils import ANY_LOG_LINE, run_ranks

    result = run_ranks(1, ["pretrain_gpt.py", *MODEL_FLAGS, "--exit-interval", "5", "--load", str(LEGACY),
                           "--mock-data", "--log-interval", "1", "--eval-iters", "0", "--num-workers", "0",
                           "--distributed-backend", "gloo", "--data-cache-path", str(tmp_path / "cache")],
                       timeout=150)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    records = {int(m.group("iteration")): float(m.group("loss")) for m in map(ANY_LOG_LINE.match,
                                                                            result.stdout.splitlines()) if m}
    assert sorted(records) == [4, 5]  # resumed after iteration 3
    assert all(torch.isfinite(torch.tensor(loss)) and 5.0 < loss < 8.0 for loss in records.values())


MEGATRON_LOADER = r'''
"""Load our model_optim_rng.pt with the real megatron-core 0.14.0 (model + optimizer) and report what it got."""
import importlib.util, json, sys
import torch
spec = importlib.util.spec_from_file_location("generate", sys.argv[1])
generate = importlib.util.module_from_spec(spec)
spec.loader.exec_module(generate)  # megatron-core's model/optimizer of the fixture, CPU shims included
from megatron.core.safe_globals import register_safe_globals

generate.init_distributed()
generate.set_seed(generate.SEED)
model = generate.build_model()
optimizer, scheduler = generate.build_optimizer(model)
register_safe_globals()  # what Megatron-LM's loader admits
state_dict = torch.load(sys.argv[2], map_location="cpu", weights_only=True)
model.module.load_state_dict(state_dict["model"], strict=True)
optimizer.load_state_dict(state_dict["optimizer"])
scheduler.load_state_dict(state_dict["opt_param_scheduler"])
reference = torch.load(sys.argv[3], weights_only=True)
model.eval()
with torch.no_grad():
    seq = reference["input_ids"].shape[1]
    mask = torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq) < 0.5
    logits = model(reference["input_ids"], reference["position_ids"], mask)
inner = optimizer.optimizer
norms = {name: [p.detach().double().norm().item(), inner.state[p]["exp_avg"].double().norm().item(),
                inner.state[p]["exp_avg_sq"].double().norm().item()] for name, p in model.module.named_parameters()}
# one more step: a moment on a param of another shape would fail here
model.train()
model.zero_grad_buffer()
optimizer.zero_grad()
tokens, labels, mask, positions = generate.ltor_batch(torch.Generator().manual_seed(7))
model(tokens, positions, mask, labels=labels).float().mean().backward()
model.finish_grad_sync()
success = optimizer.step()[0]
torch.save({"logits": logits}, sys.argv[4])
print("RESULT " + json.dumps({"norms": norms, "step": bool(success), "num_steps": scheduler.num_steps}))
'''


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.environ.get("MCORE_V014_PATH"),
                    reason="MCORE_V014_PATH (an unpacked megatron-core 0.14.0 wheel) is not set")
def test_megatron_loads_our_legacy_checkpoint(tmp_path):
    """The real megatron-core 0.14.0 loads our model_optim_rng.pt (written from a permuted-order checkpoint,
    so every moment went through the name mapping): its logits equal ours, each Adam moment on its param."""
    import json

    from megatron.training.checkpointing import load_state_dict_file

    source = tmp_path / "permuted"
    _, moved = _permuted_copy(LEGACY_FILE, source, named=False)
    assert moved == 8
    assert run_distributed(_save_after_loading, 1, source, tmp_path / "ours") == [True]
    ours = tmp_path / "ours" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    script = tmp_path / "megatron_loader.py"
    script.write_text(MEGATRON_LOADER)
    env = dict(os.environ, PYTHONPATH=os.environ["MCORE_V014_PATH"], OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, str(script), str(DATA / "generate.py"), str(ours), str(REFERENCE),
                             str(tmp_path / "logits.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("RESULT ", 1)[1])
    reference = _load_reference()
    logits = torch.load(tmp_path / "logits.pt", weights_only=True)["logits"]
    assert (logits - reference["logits"]).abs().max().item() < 1e-5
    for i, name in enumerate(reference["param_names"]):
        expected = (reference["param_norm"][i].item(), reference["exp_avg_norm"][i].item(),
                    reference["exp_avg_sq_norm"][i].item())
        assert tuple(report["norms"][name]) == pytest.approx(expected, rel=1e-6, abs=1e-12), name
    assert report["step"] and report["num_steps"] == 12
    assert load_state_dict_file(ours)["iteration"] == 3


@pytest.mark.timeout(120)
def test_optimizer_state_that_fits_no_param_is_one_line_error(tmp_path):
    """A legacy file whose optimizer groups do not hold this model's params (a param moved to the other
    group): pretrain_gpt.py stops with one line naming the file and --no-load-optim, no traceback."""
    from megatron.training.checkpointing import load_state_dict_file
    from pretrain_utils import run_ranks

    state = load_state_dict_file(LEGACY_FILE)
    groups = state["optimizer"]["param_groups"]
    groups[1]["params"].append(groups[0]["params"].pop())
    out = tmp_path / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt"
    out.parent.mkdir(parents=True)
    torch.save(state, out)
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("3")
    result = run_ranks(1, ["pretrain_gpt.py", *MODEL_FLAGS, "--load", str(tmp_path), "--mock-data",
                           "--distributed-backend", "gloo", "--num-workers", "0", "--eval-iters", "0"], timeout=100)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and str(out) in errors[0] and "--no-load-optim" in errors[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(120)
def test_convert_tool_maps_megatron_optimizer_state_by_name(tmp_path):
    """tools/checkpoint/convert.py on the Megatron file (positional state, no names) to TP=2 and back to TP=1:
    each Adam moment ends on its own param (the norms of the writer), in Megatron's positional layout."""
    from pretrain_utils import load_checkpoint_tool

    convert = load_checkpoint_tool("convert")
    assert convert.main(["--load-dir", str(LEGACY), "--save-dir", str(tmp_path / "tp2"),
                         "--target-tensor-parallel-size", "2"]) == 0
    assert convert.main(["--load-dir", str(tmp_path / "tp2"), "--save-dir", str(tmp_path / "tp1"),
                         "--target-tensor-parallel-size", "1"]) == 0
    from megatron.training.checkpointing import load_state_dict_file

    back = load_state_dict_file(tmp_path / "tp1" / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt")
    reference = _load_reference()
    names = [n for group in back["optimizer"]["param_groups"] for n in group["param_names"]]
    assert names == [n for g in reference["param_groups"] for n in g["names"]]  # Megatron's positions
    for group in back["optimizer"]["param_groups"]:
        for position, name in zip(group["params"], group["param_names"]):
            i = reference["param_names"].index(name)
            entry = back["optimizer"]["state"][position]
            assert entry["exp_avg"].double().norm().item() == pytest.approx(reference["exp_avg_norm"][i].item(),
                                                                            rel=1e-6), name
            assert entry["exp_avg_sq"].double().norm().item() == pytest.approx(
                reference["exp_avg_sq_norm"][i].item(), rel=1e-6), name


def test_mixed_precision_main_params_follow_their_names():
    """bf16/fp16 state (``fp32_from_fp16_params`` positional per group): a writer that ordered a group's params
    differently gets each main param and moment back on its own name, in this run's order."""
    from megatron.training.legacy_optimizer_state import to_megatron_layout, to_named_layout

    shapes = {"a": torch.Size([2]), "b": torch.Size([3]), "c": torch.Size([4])}
    mains = {name: torch.full(shape, float(i)) for i, (name, shape) in enumerate(shapes.items())}
    moments = {name: {"step": torch.tensor(3.0), "exp_avg": mains[name] + 10} for name in shapes}
    group = {"wd_mult": 1.0, "lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False, "lr": 1e-3}
    # the writer's order: b before a in group 0
    written = {"optimizer": {"state": {n: moments[n] for n in ("b", "a", "c")},
                             "param_groups": [dict(group, params=["b", "a"]), dict(group, wd_mult=0.0, params=["c"])]},
               "fp32_from_fp16_params": [[mains["b"], mains["a"]], [mains["c"]]]}
    positional = to_megatron_layout(written)
    assert positional["optimizer"]["param_groups"][0]["params"] == [0, 1]
    assert positional["optimizer"]["param_groups"][0]["param_names"] == ["b", "a"]
    targets = [["a", "b"], ["c"]]
    identities = [(1.0, 1.0, False, False), (0.0, 1.0, False, False)]
    named = to_named_layout(positional, targets, identities, ["a", "b", "c"], shapes, "FILE")
    assert [g["params"] for g in named["optimizer"]["param_groups"]] == [["b", "a"], ["c"]]
    for name in shapes:
        assert torch.equal(named["optimizer"]["state"][name]["exp_avg"], mains[name] + 10)
    assert [[t.tolist() for t in g] for g in named["fp32_from_fp16_params"]] == [
        [mains["a"].tolist(), mains["b"].tolist()], [mains["c"].tolist()]]
