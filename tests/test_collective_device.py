"""get_collective_device: the backend decides where a collective's tensors live; no call site decides alone."""
import ast
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

from megatron.core import collective_device, timers
from megatron.core.collective_device import device_backend_map, get_collective_device

REPO = pathlib.Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------
# The decision
# ----------------------------------------------------------------------------------------------
def _pretend_group(monkeypatch, config, cuda_available, cuda_index=5):
    """torch.distributed 'initialised' with a default group whose backend config is ``config``."""
    seen = []

    def backend_config(group=None):
        seen.append(group)
        return config

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend_config", backend_config)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: cuda_index)
    return seen


@pytest.mark.parametrize("config", ["cuda:nccl", "nccl"])
def test_nccl_group_needs_the_current_cuda_device(monkeypatch, config):
    seen = _pretend_group(monkeypatch, config, cuda_available=True, cuda_index=5)
    marker = object()
    assert get_collective_device(marker) == torch.device("cuda", 5)
    assert seen == [marker], "the group's own backend is asked, not the default group's"
    assert device_backend_map() == {"cuda": "nccl"}


def test_nccl_decision_comes_from_the_backend_not_the_hardware(monkeypatch):
    # Even if CUDA looked absent, an NCCL group cannot carry a CPU tensor: there is no CPU fallback.
    _pretend_group(monkeypatch, "cuda:nccl", cuda_available=False, cuda_index=2)
    assert get_collective_device() == torch.device("cuda", 2)


def test_older_torch_without_get_backend_config(monkeypatch):
    _pretend_group(monkeypatch, "unused", cuda_available=True, cuda_index=1)
    monkeypatch.delattr(dist, "get_backend_config")
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    assert get_collective_device() == torch.device("cuda", 1)


@pytest.mark.parametrize("cuda_available", [True, False])
def test_gloo_group_uses_the_cpu_even_with_cuda(monkeypatch, cuda_available):
    _pretend_group(monkeypatch, "cpu:gloo,cuda:gloo", cuda_available=cuda_available)
    assert get_collective_device() == torch.device("cpu")


@pytest.mark.parametrize("cuda_available,expected", [(True, torch.device("cuda", 5)), (False, torch.device("cpu"))])
def test_mixed_backend_prefers_cuda_when_present(monkeypatch, cuda_available, expected):
    _pretend_group(monkeypatch, "cpu:gloo,cuda:nccl", cuda_available=cuda_available)
    assert get_collective_device() == expected


def test_backend_without_cpu_or_cuda_is_refused(monkeypatch):
    _pretend_group(monkeypatch, "xpu:xccl", cuda_available=False)
    with pytest.raises(ValueError, match="serves neither 'cpu' nor 'cuda'"):
        get_collective_device()


@pytest.mark.parametrize("cuda_available,expected", [(True, torch.device("cuda", 3)), (False, torch.device("cpu"))])
def test_no_process_group(monkeypatch, cuda_available, expected):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_available)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert get_collective_device() == expected


def test_real_gloo_and_fake_groups():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert get_collective_device() == torch.device("cpu")
        assert get_collective_device(dist.new_group([0], backend="gloo")) == torch.device("cpu")
        # The timers' gather runs on a real group end to end.
        registry = timers.Timers(log_level=2)
        registry("step", log_level=0).start()
        registry("step").stop()
        report = registry.get_all_timers_string(["step"])
        assert report.startswith("(min, max) time across ranks (ms):") and "step" in report
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        # "fake" serves cpu and cuda: CUDA when this machine has it, else the CPU.
        expected = "cuda" if torch.cuda.is_available() else "cpu"
        assert get_collective_device().type == expected
    finally:
        dist.destroy_process_group()


class _Stop(Exception):
    pass


def test_timers_gather_on_the_helpers_device(monkeypatch):
    # A group whose tensors must live elsewhere than the CPU (NCCL: CUDA) cannot be run here, so
    # stand in the meta device for it and check the gathered tensors are built there.
    devices = []

    def spy_all_gather(outputs, local, group=None):
        devices.extend([local.device] + [t.device for t in outputs])
        raise _Stop

    monkeypatch.setattr(timers, "get_collective_device", lambda group=None: torch.device("meta"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_gather", spy_all_gather)
    registry = timers.Timers(log_level=2)
    registry("step", log_level=0).start()
    registry("step").stop()
    with pytest.raises(_Stop):
        registry.get_all_timers_string(["step"])
    assert devices == [torch.device("meta")] * 3


# ----------------------------------------------------------------------------------------------
# No collective call site chooses its device by hand
# ----------------------------------------------------------------------------------------------
_COLLECTIVES = {
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
    "broadcast", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "_reduce_scatter_base", "gather", "scatter", "all_to_all", "all_to_all_single",
    "send", "recv", "isend", "irecv",
}
_FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "as_tensor"}
_HELPER = "megatron/core/collective_device.py"
# Files allowed to call torch.cuda.current_device() besides the helper: each places a model's own
# tensors (compute), which never reach a collective directly.
_CURRENT_DEVICE_ALLOWED = {
    "megatron/training/utils.py": "get_device(): where the model and its batches live",
    "megatron/core/tensor_parallel/layers.py": "device for initialising the partitioned weights",
    "megatron/core/transformer/norms.py": "device for initialising the norm weights",
    "megatron/core/transformer/rotary_pos_embedding.py": "device of the rotary frequency buffer",
}


def _name(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_collective(call):
    func = call.func
    if not (isinstance(func, ast.Attribute) and func.attr in _COLLECTIVES):
        return False
    owner = func.value
    return (isinstance(owner, ast.Name) and owner.id == "dist") or (
        isinstance(owner, ast.Attribute) and owner.attr == "distributed")


def _own_nodes(function):
    """Nodes of ``function`` outside its nested functions and classes."""
    stack = list(function.body)
    while stack:
        node = stack.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                stack.append(child)


def _hand_made_device(node):
    """A reason if ``node`` picks a device by hand (not through get_collective_device), else None."""
    if isinstance(node, ast.Call):
        name = _name(node.func)
        if name == "current_device":
            return "torch.cuda.current_device()"
        if name == "get_device":
            return "get_device() (the compute device)"
        if name == "cuda" and isinstance(node.func, ast.Attribute) and not node.args:
            return ".cuda()"
        if name == "device" and node.args and isinstance(node.args[0], ast.Constant):
            return f"torch.device({node.args[0].value!r})"
        first = node.args[0] if node.args else None
        if name == "to" and isinstance(first, ast.Constant) and isinstance(first.value, str):
            return f".to({node.args[0].value!r})"
        for keyword in node.keywords:
            if keyword.arg == "device" and isinstance(keyword.value, ast.Constant):
                return f"device={keyword.value.value!r}"
    return None


def find_violations(source, path="<src>"):
    """(path:line, reason) for every collective call site that does not use the helper's device."""
    tree = ast.parse(source)
    violations = []
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        nodes = list(_own_nodes(function))
        calls = [n for n in nodes if isinstance(n, ast.Call) and _is_collective(n)]
        if not calls:
            continue
        for node in nodes:
            reason = _hand_made_device(node)
            if reason:
                violations.append((f"{path}:{node.lineno}", f"{function.name} picks a device by hand: {reason}"))
        # A tensor built by a factory without device= lands on the CPU whatever the backend.
        passed = {arg.id for call in calls for arg in call.args if isinstance(arg, ast.Name)}
        for node in nodes:
            if not isinstance(node, ast.Assign) or not isinstance(node.value, ast.Call):
                continue
            targets = {t.id for t in node.targets if isinstance(t, ast.Name)}
            value = node.value
            if (targets & passed and _name(value.func) in _FACTORIES
                    and not any(k.arg == "device" for k in value.keywords)):
                violations.append((f"{path}:{node.lineno}",
                                   f"{function.name} builds {sorted(targets & passed)} without device="))
    return violations


def _package_files():
    return sorted(p for p in (REPO / "megatron").rglob("*.py"))


def test_no_collective_call_site_picks_its_device_by_hand():
    violations = []
    for path in _package_files():
        violations += find_violations(path.read_text(), str(path.relative_to(REPO)))
    assert not violations, "use megatron.core.collective_device.get_collective_device:\n" + "\n".join(
        f"{where}: {why}" for where, why in violations)


def test_current_device_is_read_only_by_the_helper_and_model_placement():
    offenders = []
    for path in _package_files():
        relative = str(path.relative_to(REPO))
        if relative == _HELPER or relative in _CURRENT_DEVICE_ALLOWED:
            continue
        if "current_device()" in path.read_text():
            offenders.append(relative)
    assert not offenders, f"a copy of the device decision; use get_collective_device: {offenders}"


def test_the_scan_catches_the_old_patterns():
    timers_before = (
        "def gather(names):\n"
        "    local = torch.tensor([1.0], dtype=torch.float64)\n"
        "    gathered = [torch.zeros_like(local) for _ in range(2)]\n"
        "    dist.all_gather(gathered, local)\n"
    )
    by_hand = (
        "def agree(group):\n"
        "    device = torch.device('cpu')\n"
        "    if dist.get_backend(group) == 'nccl':\n"
        "        device = torch.device('cuda', torch.cuda.current_device())\n"
        "    buf = torch.zeros(4, device=device)\n"
        "    dist.broadcast(buf, src=0, group=group)\n"
    )
    compute_device = (
        "def any_rank(flag):\n"
        "    value = torch.tensor([flag], device=get_device())\n"
        "    torch.distributed.all_reduce(value)\n"
    )
    fixed = (
        "def agree(group):\n"
        "    buf = torch.zeros(4, device=get_collective_device(group))\n"
        "    dist.broadcast(buf, src=0, group=group)\n"
        "    return buf.cpu()\n"
    )
    assert [why for _, why in find_violations(timers_before)] == ["gather builds ['local'] without device="]
    assert len(find_violations(by_hand)) == 3
    assert find_violations(compute_device) == [
        ("<src>:2", "any_rank picks a device by hand: get_device() (the compute device)")]
    assert find_violations(fixed) == []


def test_helper_module_imports_only_torch():
    tree = ast.parse((REPO / _HELPER).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert imported <= {"typing", "torch"}, imported
    assert collective_device.__doc__.startswith("The one place that decides")
