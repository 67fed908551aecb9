"""What `make demo` and `make test` install: the demo gets torch, the package and its own extra (no
Lightning, transformers or Ray), the tests the whole dev extra. (That the demo runs with its set alone was
checked in a fresh venv: README, "The two commands".)"""

import shutil
import subprocess
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def planned(target: str) -> str:
    """The commands `make` would run for ``target`` in a fresh clone (-B: as if nothing were installed)."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    return subprocess.run(
        ["make", "-n", "-B", target], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout


def extra(name: str) -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"][name]


def test_make_demo_installs_the_demo_extra_and_make_test_the_dev_extra():
    demo, test = planned("demo"), planned("test")
    assert '-e ".[demo]"' in demo and ".[dev]" not in demo
    assert '-e ".[dev]"' in test
    heavy = {
        "lightning",
        "transformers",
        "accelerate",
        "ray",
        "torchmetrics",
        "netcal",
        "relplot",
        "hypothesis",
    }
    names = {r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in extra("demo")}
    assert not names & heavy and {"matplotlib", "typer", "rich", "pyyaml"} <= names
    assert set(extra("demo")) <= set(extra("dev"))  # `make test` covers what the demo needs


def test_make_test_type_checks_src_and_the_package_ships_py_typed():
    test = planned("test")
    assert "pyright --pythonpath .venv/bin/python" in test
    assert test.index("pyright") < test.index("pytest")  # a type error stops `make test` before the tests
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pyright = config["tool"]["pyright"]
    assert pyright["include"] == ["src"] and pyright["typeCheckingMode"] == "standard"
    assert any(r.startswith("pyright[nodejs]==") for r in extra("dev"))  # pinned, Node.js from a wheel
    assert (ROOT / "src" / "torchcal" / "py.typed").is_file()
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["torchcal"]
