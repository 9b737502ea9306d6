"""Measures of the code's structure (args reads, import cycles, file sizes, private names, file-name literals).

Each function scans the source with ``ast`` (or plain text where the rule is textual) and returns what it
found, so ``tests/test_architecture_rules.py`` can assert on it and ``python tests/architecture_scan.py``
prints the figures that docs/ARCHITECTURE.md quotes. Imports inside functions count like any other:
a cycle closed by a function-level import is still a cycle.
"""
from __future__ import annotations

import ast
import pathlib
import re
import sys
from typing import Dict, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The two modules allowed to read ``args`` attributes freely: the parser/validator and the one adapter
# that turns the validated Namespace into the typed configuration.
ARGS_ADAPTERS = ("megatron/training/arguments.py", "megatron/training/argument_utils.py")

# The on-disk names of a checkpoint; only the layout module spells them out.
CHECKPOINT_FILE_NAMES = ("mp_rank_", "common.pt", "model_optim_rng.pt", "latest_checkpointed_iteration.txt")


def python_files(root: pathlib.Path, *patterns: str) -> List[pathlib.Path]:
    """Sorted ``.py`` files under ``root`` matching the glob ``patterns``, caches excluded."""
    found: Set[pathlib.Path] = set()
    for pattern in patterns:
        found.update(p for p in root.glob(pattern) if "__pycache__" not in p.parts and p.is_file())
    return sorted(found)


def _rel(root: pathlib.Path, path: pathlib.Path) -> str:
    return path.relative_to(root).as_posix()


def args_reads(root: pathlib.Path = ROOT) -> Dict[str, int]:
    """``{file: n}``: reads of ``args.<name>`` plus ``getattr/hasattr(args, ...)`` calls in ``megatron/``
    and ``pretrain_gpt.py``, outside :data:`ARGS_ADAPTERS`. Files with none are left out."""
    counts: Dict[str, int] = {}
    for path in python_files(root, "megatron/**/*.py", "pretrain_gpt.py"):
        rel = _rel(root, path)
        if rel in ARGS_ADAPTERS:
            continue
        n = 0
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args"
                    and isinstance(node.ctx, ast.Load)):
                n += 1
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr") and node.args
                  and isinstance(node.args[0], ast.Name) and node.args[0].id == "args"):
                n += 1
        if n:
            counts[rel] = n
    return counts


_CORE_ARGS = re.compile(r"get_args\(|getattr\(args|\bargs\.[A-Za-z_]")


def core_args_lines(root: pathlib.Path = ROOT) -> List[str]:
    """``file:line: text`` of every ``get_args(``, ``getattr(args`` or ``args.<name>`` under megatron/core
    (textual, as the issue's ``grep``: comments and docstrings count too)."""
    hits = []
    for path in python_files(root, "megatron/core/**/*.py"):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _CORE_ARGS.search(line):
                hits.append(f"{_rel(root, path)}:{number}: {line.strip()}")
    return hits


def _module_table(root: pathlib.Path) -> Dict[str, Tuple[pathlib.Path, bool]]:
    table = {}
    for path in python_files(root, "megatron/**/*.py", "tools/**/*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        table[".".join(parts)] = (path, is_package)
    return table


def import_graph(root: pathlib.Path = ROOT) -> Dict[str, Set[str]]:
    """Module -> modules it imports (anywhere in the file, functions included) within megatron/ and tools/.

    ``from pkg import name`` points at ``pkg.name`` when that is a module, else at the submodule the
    package ``__init__`` re-exports ``name`` from, else at the package. Importing ``a.b.c`` also runs the
    ``__init__`` of ``a`` and ``a.b``, so those are edges too, unless the importer lives inside them.
    """
    table = _module_table(root)

    def resolve(name: str):
        while name and name not in table:
            name = name.rpartition(".")[0]
        return name or None

    def reexports(package: str) -> Dict[str, str]:
        found = {}
        for node in ast.parse(table[package][0].read_text()).body:
            if isinstance(node, ast.ImportFrom) and node.module:
                source = f"{package}.{node.module}" if node.level == 1 else node.module
                if node.level in (0, 1) and source.startswith(package + "."):
                    for alias in node.names:
                        found[alias.asname or alias.name] = source
        return found

    graph: Dict[str, Set[str]] = {name: set() for name in table}
    for module, (path, is_package) in table.items():
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    if full in table:
                        targets.append(full)
                    elif base in table and table[base][1]:
                        targets.append(reexports(base).get(alias.name, base))
                    else:
                        targets.append(base)
            for target in targets:
                resolved = resolve(target)
                if not resolved or resolved == module:
                    continue
                graph[module].add(resolved)
                parts = resolved.split(".")
                for i in range(1, len(parts)):
                    ancestor = ".".join(parts[:i])
                    if ancestor in table and not (module == ancestor or module.startswith(ancestor + ".")):
                        graph[module].add(ancestor)
    return graph


def import_cycles(root: pathlib.Path = ROOT) -> List[List[str]]:
    """Strongly connected components of :func:`import_graph` with more than one module (Tarjan 1972)."""
    graph = import_graph(root)
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    cycles: List[List[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10000))
    try:
        for vertex in sorted(graph):
            if vertex not in index:
                visit(vertex)
    finally:
        sys.setrecursionlimit(limit)
    return cycles


def long_files(root: pathlib.Path = ROOT, limit: int = 900) -> Dict[str, int]:
    """``{file: lines}`` for the ``.py`` files under megatron/ and tools/ longer than ``limit`` lines."""
    out = {}
    for path in python_files(root, "megatron/**/*.py", "tools/**/*.py"):
        n = len(path.read_text().splitlines())
        if n > limit:
            out[_rel(root, path)] = n
    return out


def private_uses(root: pathlib.Path = ROOT) -> List[str]:
    """Private names (one leading underscore) of the ``megatron`` package that tools/ or pretrain_gpt.py
    import or reach through an imported module, as ``file: name``."""
    found = []
    for path in python_files(root, "tools/**/*.py", "pretrain_gpt.py"):
        tree = ast.parse(path.read_text())
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("megatron"):
                for alias in node.names:
                    if alias.name.startswith("_"):
                        found.append(f"{_rel(root, path)}: from {node.module} import {alias.name}")
                    else:
                        modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("megatron"):
                        modules.add(alias.asname or alias.name.split(".")[0])
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                    and isinstance(node.value, ast.Name) and node.value.id in modules):
                found.append(f"{_rel(root, path)}: {node.value.id}.{node.attr}")
    return found


def files_calling(root: pathlib.Path, text: str) -> List[str]:
    """The ``.py`` files under megatron/, tools/ and pretrain_gpt.py whose code (not docstrings or comments)
    contains ``text`` inside a call's name or a string constant."""
    out = []
    for path in python_files(root, "megatron/**/*.py", "tools/**/*.py", "pretrain_gpt.py"):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)
                      and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                if text in node.value:
                    out.append(_rel(root, path))
                    break
            if isinstance(node, ast.Call) and text.endswith("(") and ast.unparse(node.func) == text[:-1]:
                out.append(_rel(root, path))
                break
    return out


def report(root: pathlib.Path = ROOT) -> str:
    """The measures as text, one per line."""
    reads = args_reads(root)
    lines = [f"args attribute reads outside {', '.join(ARGS_ADAPTERS)}: {sum(reads.values())} in {len(reads)} files"]
    lines += [f"    {n:4d} {name}" for name, n in sorted(reads.items(), key=lambda kv: -kv[1])]
    lines.append(f"get_args(/getattr(args/args.<name> lines under megatron/core: {len(core_args_lines(root))}")
    cycles = import_cycles(root)
    lines.append(f"import cycles (imports inside functions included): {len(cycles)}")
    lines += [f"    {' <-> '.join(c)}" for c in cycles]
    lines.append(f"files over 900 lines under megatron/ and tools/: {long_files(root)}")
    private = private_uses(root)
    lines.append(f"private megatron names used by tools/ and pretrain_gpt.py: {len(private)}")
    lines += [f"    {p}" for p in private]
    lines.append(f"files calling torch.load: {files_calling(root, 'torch.load(')}")
    for name in CHECKPOINT_FILE_NAMES:
        lines.append(f"files spelling {name!r} in code: {files_calling(root, name)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report(pathlib.Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT))
