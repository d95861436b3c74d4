"""Layers you can see: no import cycle among hpcrun's modules, and nothing below the CLI imports
it. Every import is an edge: function-level ones, and `if TYPE_CHECKING:` ones too (they never
run, but a module that needs another's types to be checked knows it: two modules that know each
other share a job)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import ROOT


def modules(package: Path) -> dict[str, Path]:
    found = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The hpcrun modules `name` imports anywhere in its body, as their dotted names."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def owner(dotted: str) -> str | None:  # `hpcrun.plan.RunSpec` -> `hpcrun.plan`
        while dotted and dotted not in known:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    found: set[str | None] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(owner(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:  # `from hpcrun import backend` imports the module hpcrun.backend
                full = f"{base}.{alias.name}"
                found.add(full if full in known else owner(base))
    return {m for m in found if m and m != name}


def graph(package: Path) -> dict[str, set[str]]:
    known = modules(package)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles() -> None:
    found = cycles(graph(ROOT / "hpcrun"))
    assert found == [], "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_only_the_cli_imports_the_cli() -> None:
    edges = graph(ROOT / "hpcrun")
    upward = sorted(
        f"{m} -> {d}"
        for m, deps in edges.items()
        if not m.startswith("hpcrun.cli") and m != "hpcrun.__main__"
        for d in deps
        if d.startswith("hpcrun.cli")
    )
    assert upward == []


def test_the_check_sees_cycles_through_lazy_imports(tmp_path: Path) -> None:
    """The checker itself: a cycle closed by a function-level import is found, and so is one
    closed only under TYPE_CHECKING."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import thing\n")
    (pkg / "c.py").write_text("import typing as tp\nif tp.TYPE_CHECKING:\n    from pkg.d import X\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert cycles(graph(pkg)) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]


# the run directory's names that are words of other vocabularies too: a results column (`steps`),
# a recipe field and a package (`tensorboard`), and DeepSpeed's checkpoint tag (`state`)
SHARED_WORDS = {"steps", "tensorboard", "state"}


def spelled_names(package: Path) -> list[str]:
    """String constants outside hpcrun.rundir (documentation aside) that spell one of its file or
    directory names, whole or as the fixed part of an f-string (`f"step-{n:08d}"`)."""
    import hpcrun.rundir

    owned = {v for k, v in vars(hpcrun.rundir).items() if k.isupper() and isinstance(v, str)} - SHARED_WORDS
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "rundir.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}  # fields' ones too
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
                hits = [n for n in owned if text == n or (len(n) > 4 and ("." in n or "-" in n) and n in text)]
                if hits:
                    found.append(f"{path.relative_to(package.parent)}:{node.lineno}: {text!r} ({', '.join(hits)})")
    return found


def test_only_rundir_spells_the_run_directorys_names() -> None:
    """One owner for each place on disk: the others ask hpcrun.rundir for a path."""
    found = spelled_names(ROOT / "hpcrun")
    assert found == [], "file names spelled outside hpcrun.rundir:\n" + "\n".join(found)


SLURM_TOOLS = re.compile(r"""\[\s*["'](sacct|sacctmgr|sbatch|scancel|scontrol|sinfo|squeue|sprio|sshare)["']""")


def test_only_the_slurm_module_builds_slurm_command_lines() -> None:
    """One owner for what hpcrun asks SLURM: a command line (`["sacct", ...]`) appears in
    hpcrun/slurm.py only; the others call its builders."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "hpcrun").rglob("*.py"))
        if path.name != "slurm.py" or path.parent.name != "hpcrun"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if SLURM_TOOLS.search(line)
    ]
    assert found == [], "SLURM command lines built outside hpcrun.slurm:\n" + "\n".join(found)
