"""The library's seams: public names only across folders, dependencies one way, thin CLI modules."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import sharding

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sharding", "models", "partition_rules")
SUBPACKAGES = ("pipeline", "inspection", "costmodel", "comparison", "planning", "training")


def imports(path: Path) -> list[tuple[int, str]]:
    """Every imported module path in a file, with the imported names as ``module.name``."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def private(module: str, *, allow: str = "") -> bool:
    parts = module.split(".")
    if parts[0] not in PACKAGES or (allow and module.startswith(allow)):
        return False
    return any(p.startswith("_") and not p.startswith("__") for p in parts[1:])


def files(*folders: str) -> list[Path]:
    return sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))


@pytest.mark.parametrize("folder", ["tests", "benchmarks"])
def test_tests_and_benchmarks_import_only_public_names(folder):
    bad = [f"{p.relative_to(ROOT)}:{line} {m}" for p in files(folder) for line, m in imports(p)
           if private(m)]  # fmt: skip
    assert not bad, "private imports:\n" + "\n".join(bad)


def test_cli_imports_only_public_names():
    bad = [f"{p.relative_to(ROOT)}:{line} {m}" for p in files("sharding/cli")
           for line, m in imports(p) if private(m, allow="sharding.cli.")]  # fmt: skip
    assert not bad, "the CLI imports private names:\n" + "\n".join(bad)


def test_dependencies_point_one_way():
    library = [p for p in files("sharding") if "cli" not in p.relative_to(ROOT).parts]
    bad = [f"{p.relative_to(ROOT)}:{line} {m}" for p in library for line, m in imports(p)
           if m.split(".")[0] == "models"]  # fmt: skip
    bad += [f"{p.relative_to(ROOT)}:{line} {m}" for p in files("models", "partition_rules")
            for line, m in imports(p) if m.split(".")[0] == "sharding"]  # fmt: skip
    assert not bad, "imports against the one-way dependencies:\n" + "\n".join(bad)


def test_subpackages_import_each_other_through_their_public_names():
    bad = []
    for p in files("sharding"):
        rel = p.relative_to(ROOT / "sharding").parts
        home = rel[0] if len(rel) > 1 else None
        for line, m in imports(p):
            parts = m.split(".")
            if (parts[0] == "sharding" and len(parts) > 2 and parts[1] in SUBPACKAGES
                    and parts[1] != home and parts[2].startswith("_")):  # fmt: skip
                bad.append(f"sharding/{'/'.join(rel)}:{line} {m}")
    assert not bad, "private modules imported across folders:\n" + "\n".join(bad)


def test_the_cost_model_imports_no_command():
    """compare and plan sit above the cost model (`sharding.planning` uses both): nothing in
    sharding/costmodel imports them, the CLI or training, at module level or in a function."""
    above = ("sharding.comparison", "sharding.planning", "sharding.cli", "sharding.training")
    bad = [f"{p.relative_to(ROOT)}:{line} {m}" for p in files("sharding/costmodel")
           for line, m in imports(p) if m.startswith(above)]  # fmt: skip
    assert not bad, "the cost model imports a command:\n" + "\n".join(bad)


def test_module_sizes():
    lines = {p.relative_to(ROOT): len(p.read_text().splitlines()) for p in files("sharding")}
    lines |= {p.relative_to(ROOT): len(p.read_text().splitlines())
              for p in files("models", "partition_rules")}  # fmt: skip
    too_long = {str(p): n for p, n in lines.items() if n > 400}
    assert not too_long, f"modules over 400 lines: {too_long}"
    cli = {str(p): n for p, n in lines.items() if p.parts[:2] == ("sharding", "cli") and n >= 150}
    assert not cli, f"CLI modules of 150 lines or more: {cli}"


@pytest.mark.parametrize(
    "name",
    [
        "sharding",
        *(f"sharding.{s}" for s in SUBPACKAGES),
        "sharding.cli",
        "models",
        "partition_rules",
    ],
)
def test_every_public_name_exists(name):
    package = importlib.import_module(name)
    missing = [n for n in package.__all__ if not hasattr(package, n)]
    assert not missing, f"{name}.__all__ names what it does not have: {missing}"


def test_errors_are_grouped_under_one_root():
    roots = {
        sharding.MeshSpecError, sharding.RuleError, sharding.StepConfigError,
        sharding.pipeline.PipelineError, sharding.inspection.InspectionError,
        sharding.costmodel.CostModelError, sharding.training.TrainingError,
    }  # fmt: skip
    assert all(issubclass(r, sharding.SpmdkitError) for r in roots)
    for sub in SUBPACKAGES:
        package = getattr(sharding, sub)
        for n in package.__all__:
            obj = getattr(package, n)
            if inspect.isclass(obj) and issubclass(obj, Exception) and issubclass(obj, ValueError):
                assert issubclass(obj, sharding.SpmdkitError), f"sharding.{sub}.{n}"


@pytest.mark.parametrize("name", ["compare", "plan", "explain", "fit", "reshard", "launch"])
def test_every_command_is_one_documented_library_call(name, capsys):
    entry = getattr(sharding, name)
    assert inspect.isfunction(entry) and name in sharding.__all__
    help(entry)
    shown = capsys.readouterr().out
    assert f"{name}(" in shown and ("Example" in shown or "Args" in shown)


def test_the_core_docstring_examples_run(doctests):
    assert doctests(sharding) > 0
