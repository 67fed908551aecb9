"""The runner's packages import one way: shared leaves (errors, run files) <- data, models <- config <-
evaluation (of saved logits) <- training (which ends by fitting the run's calibrators) <- reports <- the
command line (cli, demo, sweep). A module may import its own layer and the layers below it, never one above:
data and models never import the config, training or reports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import torchcal.experiments as experiments

ROOT = Path(experiments.__file__).parent

# layer of each top-level part of torchcal.experiments (a subpackage or a module)
LAYERS = {
    "errors": 0, "run_files": 0,
    "data": 1, "models": 1,
    "config": 2,  # its schema's choices come from the data catalog and the model registry
    "evaluation": 3,
    "training": 4,
    "reports": 5,
    "cli": 6, "demo": 6, "sweep": 6, "__init__": 6,
}  # fmt: skip


def _part(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_parts(path: Path, root: Path = ROOT) -> set[tuple[str, int]]:
    """(part of torchcal.experiments, line) of every import in ``path`` that lands in the runner."""
    tree = ast.parse(path.read_text())
    rel = path.relative_to(root)
    package = list(rel.parts[:-1])  # the module's package inside experiments
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                up = node.level - 1
                if up > len(package):
                    continue  # torchcal's core (from ... import functional)
                base = package[: len(package) - up]
                target = base + (node.module.split(".") if node.module else [])
                if not target:  # from . import x (inside experiments/__init__)
                    target = [a.name for a in node.names]
                    out |= {(t, node.lineno) for t in target}
                    continue
                out.add((target[0], node.lineno))
            elif node.module and node.module.startswith("torchcal.experiments."):
                out.add((node.module.split(".")[2], node.lineno))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("torchcal.experiments."):
                    out.add((alias.name.split(".")[2], node.lineno))
    return out


MODULES = sorted(p for p in ROOT.rglob("*.py"))


def test_every_part_has_a_layer():
    parts = {_part(p) for p in MODULES}
    assert parts <= set(LAYERS), f"parts without a layer: {sorted(parts - set(LAYERS))}"
    assert {"data", "models", "training", "evaluation", "reports"} <= parts


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_point_down(path):
    own = LAYERS[_part(path)]
    upward = sorted(
        f"line {line}: {target}"
        for target, line in _imported_parts(path)
        if target in LAYERS and LAYERS[target] > own
    )
    assert not upward, f"{path.relative_to(ROOT)} (layer {own}) imports a higher layer: {upward}"


def test_the_checker_sees_an_upward_import(tmp_path):
    # the checker itself: a data module importing training is reported, torchcal's core is not
    bad = tmp_path / "experiments" / "data" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from ..training import train\nfrom ...functional import calibration\n")
    assert _imported_parts(bad, tmp_path / "experiments") == {("training", 1)}
