"""The structure rules of docs/ARCHITECTURE.md, checked on the source: who reads ``args``, import cycles,
file sizes, private names across packages, where checkpoints are read and named (issue 29's "Done means")."""
import textwrap

import pytest

from tests import architecture_scan as scan

pytestmark = pytest.mark.timeout(120)


def test_core_reads_no_args():
    """megatron/core takes typed configs; the issue's grep finds nothing there."""
    assert scan.core_args_lines() == []


def test_args_reads_outside_the_adapter_are_few():
    """At most 120 ``args`` attribute reads outside arguments.py and argument_utils.py (465 before)."""
    reads = scan.args_reads()
    assert sum(reads.values()) <= 120, reads


def test_no_import_cycle():
    assert scan.import_cycles() == []


def _imports_of(prefix):
    """``{module: targets}`` of the import graph for the modules named ``prefix`` or under it."""
    return {module: targets for module, targets in scan.import_graph().items()
            if module == prefix or module.startswith(prefix + ".")}


def test_core_never_imports_training():
    """The library below, the driver above: megatron/core works without megatron/training."""
    wrong = {m: sorted(t for t in ts if t.startswith("megatron.training"))
             for m, ts in _imports_of("megatron.core").items()}
    assert {m: ts for m, ts in wrong.items() if ts} == {}


def test_config_package_holds_only_typed_records():
    """megatron/training/config builds on core's configs and nothing else of the project (no args, no loop)."""
    wrong = {m: sorted(t for t in ts
                       if t.startswith("megatron.training") and not t.startswith("megatron.training.config"))
             for m, ts in _imports_of("megatron.training.config").items()}
    assert {m: ts for m, ts in wrong.items() if ts} == {}


@pytest.mark.parametrize("module", ["mapping", "serialization", "safe_loading", "core"])
def test_the_checkpoint_format_engine_knows_no_model(module):
    """The torch_dist engine (chunks, save/load, safe reads, errors) imports no model code; the GPT key layout
    lives in models/gpt/checkpoint_keys.py (design note 3.1). ``transformer.enums`` is data, not model code:
    the enums Megatron-LM pickles into saved args, which safe_loading must admit."""
    targets = _imports_of(f"megatron.core.dist_checkpointing.{module}")[f"megatron.core.dist_checkpointing.{module}"]
    model_code = [t for t in targets if t.startswith(("megatron.core.models", "megatron.core.transformer"))
                  and t not in ("megatron.core.transformer", "megatron.core.transformer.enums")]
    assert model_code == []


def test_no_file_over_900_lines():
    assert scan.long_files() == {}


def test_tools_use_only_public_names():
    assert scan.private_uses() == []


def test_torch_load_lives_in_safe_loading_only():
    """Every ``torch.load`` goes through the one module that owns the weights-only rules."""
    assert scan.files_calling(scan.ROOT, "torch.load(") == ["megatron/core/dist_checkpointing/safe_loading.py"]


@pytest.mark.parametrize("name", scan.CHECKPOINT_FILE_NAMES)
def test_checkpoint_file_names_live_in_layout_only(name):
    assert scan.files_calling(scan.ROOT, name) == ["megatron/training/checkpointing/layout.py"]


def _tree(tmp_path, files):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return tmp_path


def test_scanner_sees_a_cycle_closed_inside_a_function(tmp_path):
    """The checks above can fail: a cycle hidden in a function-level import, a core ``args`` read, a long
    file, a private name used by a tool and a stray ``torch.load`` are each found in a made-up tree."""
    root = _tree(tmp_path, {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/a.py": "from megatron.core import b\n",
        "megatron/core/b.py": "def f(args):\n    from megatron.core.a import x\n    return args.micro_batch_size\n",
        "megatron/core/long.py": "x = 1\n" * 901,
        "tools/t.py": "import torch\nfrom megatron.core.a import _private\ntorch.load('x')\n",
    })
    assert scan.import_cycles(root) == [["megatron.core.a", "megatron.core.b"]]
    assert scan.core_args_lines(root) == ["megatron/core/b.py:3: return args.micro_batch_size"]
    assert scan.args_reads(root) == {"megatron/core/b.py": 1}
    assert scan.long_files(root) == {"megatron/core/long.py": 901}
    assert scan.private_uses(root) == ["tools/t.py: from megatron.core.a import _private"]
    assert scan.files_calling(root, "torch.load(") == ["tools/t.py"]


def test_scanner_follows_package_reexports(tmp_path):
    """``from pkg import name`` counts as an import of the submodule the package re-exports it from, and
    importing a submodule runs its package's ``__init__``: the ``core.utils`` <-> ``core.distributed``
    shape of cycle."""
    root = _tree(tmp_path, {
        "megatron/__init__.py": "",
        "megatron/core/__init__.py": "",
        "megatron/core/utils.py": "def g():\n    from megatron.core.distributed import DDP\n",
        "megatron/core/distributed/__init__.py": "from .ddp import DDP\nfrom .finalize import finalize\n",
        "megatron/core/distributed/ddp.py": "class DDP: pass\n",
        "megatron/core/distributed/finalize.py": "from megatron.core.utils import g\n",
    })
    cycles = scan.import_cycles(root)
    assert cycles == [["megatron.core.distributed", "megatron.core.distributed.finalize", "megatron.core.utils"]]
