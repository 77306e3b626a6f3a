"""Imports point down only: errors.py < kernels/, data/ < model/ < training/ (< train.py, scripts/).

Every import statement of the layers' files is read (those inside functions too) and resolved to the
first-party package it reaches; a file may reach only its own package and the ones below it.
"""
import ast

import pytest

from conftest import REPO

# What each layer may import from the others (its own package always).
BELOW = {
    "errors": set(),
    "kernels": {"errors"},
    "data": {"errors"},
    "model": {"errors", "kernels"},
    "training": {"errors", "kernels", "data", "model"},
}
LAYER_FILES = [REPO / "errors.py"] + sorted(p for layer in BELOW if layer != "errors" for p in (REPO / layer).rglob("*.py"))


def layer_of(path) -> str:
    return path.relative_to(REPO).parts[0].removesuffix(".py")


def first_party_imports(source: str, package: str):
    """(line, layer) of each import in ``source`` (a file of ``package``) that reaches one of the layers."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [package] if node.level else [node.module]  # a relative import stays in its package
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in BELOW:
                yield node.lineno, top


@pytest.mark.parametrize("path", LAYER_FILES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_layer_imports_a_layer_above_it(path):
    package = layer_of(path)
    upward = [f"{path.relative_to(REPO)}:{line} imports {top}" for line, top in first_party_imports(path.read_text(), package)
              if top != package and top not in BELOW[package]]
    assert not upward, "; ".join(upward)


def test_the_walk_sees_imports_inside_functions_and_relative_ones():
    source = "import os\nfrom . import loader\ndef f():\n    import training.loop\n    from model.gpt import GPT\n"
    assert list(first_party_imports(source, "data")) == [(2, "data"), (4, "training"), (5, "model")]


@pytest.mark.parametrize("script", ["sample", "export_hf"])
def test_the_scripts_that_read_a_run_start_without_hydra(script):
    """Hydra costs about 0.4 s of a start; a script that only reads a run's folder needs none of it."""
    import subprocess
    import sys

    code = f"import sys, scripts.{script}; assert 'hydra' not in sys.modules, '{script}'"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
