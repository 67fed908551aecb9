"""The core imports only torch and numpy."""

import subprocess
import sys


def test_import_torchcal_stays_light():
    code = (
        "import sys, torchcal, torchcal.calibrators, torchcal.metrics, torchcal.plotting\n"
        "heavy = [m for m in ('matplotlib', 'scipy', 'sklearn', 'pandas', 'torchcal.experiments') if m in sys.modules]\n"
        "print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_public_api_is_reexported():
    import torchcal

    for name in (
        "expected_calibration_error",
        "ece",
        "smooth_calibration_error",
        "CalibrationMetrics",
        "focal_calibration_map",
        "bootstrap_ci",
        "ood_auroc",
        "confidence_at_least",
    ):
        assert hasattr(torchcal, name), name


def test_type_checkers_see_the_top_level_metric_functions():
    """torchcal re-exports functional.METRIC_FUNCTIONS at run time through globals(), which a type checker
    does not execute: its TYPE_CHECKING block binds the same names (``from .functional import x as x``, the
    re-export form of a typed package), and a metric added to one list must be added to the other."""
    import ast
    import pathlib

    import torchcal.functional as F

    init = pathlib.Path(F.__file__).parents[1] / "__init__.py"  # torchcal/__init__.py
    tree = ast.parse(init.read_text())
    (block,) = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"]
    bound = [
        alias.name
        for node in block.body
        if isinstance(node, ast.ImportFrom) and node.module == "functional" and node.level == 1
        for alias in node.names
        if alias.asname == alias.name
    ]
    missing, extra = set(F.METRIC_FUNCTIONS) - set(bound), set(bound) - set(F.METRIC_FUNCTIONS)
    assert not missing and not extra, f"{init}: add {sorted(missing)}, remove {sorted(extra)}"
    assert len(bound) == len(set(bound))


def _import_graph():
    """{module: the torchcal modules it imports} from the source (module level and inside functions)."""
    import ast
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1] / "src"
    graph = {}
    for path in sorted((root / "torchcal").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        package = module if is_package else module.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    deps.update(f"{target}.{alias.name}" for alias in node.names)
                else:
                    deps.add(target)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchcal"):
                deps.add(node.module)
        graph[module] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles():
    """No module reaches itself through imports, except a package's __init__ through its own children
    (a package imports its submodules; a submodule importing a sibling is not an import of the package)."""
    graph = _import_graph()
    cycles = []

    def reach(start):
        seen, todo = set(), [start]
        while todo:
            for dep in graph[todo.pop()]:
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
        return seen

    for module in graph:
        is_package = any(other.startswith(module + ".") for other in graph)
        if module in reach(module) and not is_package:
            cycles.append(module)
    assert cycles == [], cycles


def test_argument_checking_is_a_leaf():
    graph = _import_graph()
    assert graph["torchcal._validation"] == set()
    assert graph["torchcal.functional._spec"] == set()
    # which implementation runs is decided in the seam only
    users = {m for m, deps in graph.items() if "torchcal.functional._extension" in deps}
    assert users <= {"torchcal.functional._backend", "torchcal.functional"}, users


CORE_NAMESPACES = [
    "torchcal",
    "torchcal.adafocal",
    "torchcal.calibrators",
    "torchcal.calibrators.base",
    "torchcal.calibrators.bbq",
    "torchcal.calibrators.beta",
    "torchcal.calibrators.binary",
    "torchcal.calibrators.dirichlet",
    "torchcal.calibrators.model",
    "torchcal.calibrators.neural",
    "torchcal.calibrators.nonparametric",
    "torchcal.calibrators.scaling",
    "torchcal.calibrators.structured",
    "torchcal.calibrators.temperature",
    "torchcal.calibrators.venn_abers",
    "torchcal.conformal",
    "torchcal.functional",
    "torchcal.functional.binary",
    "torchcal.functional.bootstrap",
    "torchcal.functional.calibration",
    "torchcal.functional.conformal",
    "torchcal.functional.cumulative",
    "torchcal.functional.decomposition",
    "torchcal.functional.focal_map",
    "torchcal.functional.fused_head",
    "torchcal.functional.losses",
    "torchcal.functional.margin",
    "torchcal.functional.selective",
    "torchcal.functional.significance",
    "torchcal.losses",
    "torchcal.metrics",
    "torchcal.plotting",
]


def test_every_core_module_is_walked():
    """The walk below covers every public module of the core (the runner and the adapters are apart)."""
    import pkgutil

    import torchcal

    found = {"torchcal"} | {
        m.name
        for m in pkgutil.walk_packages(torchcal.__path__, "torchcal.")
        if not any(part.startswith("_") for part in m.name.split("."))
        and not m.name.startswith(("torchcal.experiments", "torchcal.integrations"))
    }
    assert found == set(CORE_NAMESPACES)


def test_public_namespaces_list_public_names_only():
    """dir() of each public namespace holds its __all__ and its public submodules only: no json, os,
    annotations, torch or checking helpers; and every name in __all__ exists."""
    import importlib
    import types

    for name in CORE_NAMESPACES:
        module = importlib.import_module(name)
        assert module.__all__, name
        missing = [n for n in module.__all__ if not hasattr(module, n)]
        assert missing == [], (name, missing)
        shown = {n for n in dir(module) if not n.startswith("_")}
        submodules = {n for n in shown if isinstance(getattr(module, n), types.ModuleType)}
        assert all(getattr(module, n).__name__ == f"{name}.{n}" for n in submodules), name
        assert shown - submodules <= set(module.__all__), (
            name,
            sorted(shown - submodules - set(module.__all__)),
        )
        for leaked in ("json", "os", "annotations", "torch", "np"):
            assert leaked not in shown, (name, leaked)


def test_registries_take_names_in_any_case():
    from torchcal import calibrators, losses

    assert type(calibrators.create("TS")) is type(calibrators.create("ts"))
    assert type(calibrators.create("Temperature_Scaling")) is calibrators.TemperatureScaling
    assert type(calibrators.create("PLATT", task="multilabel")) is calibrators.PlattScaling
    assert calibrators.from_spec("TS:objective=ece").objective == "ece"
    assert type(losses.create("FL-3")) is losses.FocalLoss
    import pytest

    with pytest.raises(ValueError, match="unknown calibrator 'tss'"):
        calibrators.create("tss")
    with pytest.raises(TypeError, match="a calibrator name must be a string"):
        calibrators.create(3)
