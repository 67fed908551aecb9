"""The documentation site (mkdocs.yml, docs/): the strict build passes with no warning, every code example on
its pages runs as a doctest or is deliberately marked as not executed, the include hook and the docstring
extension do what docs/mkdocs_hooks.py says, and the guide pages name every registered loss, calibrator,
sweep and command."""

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"

# fences that show something to read or type, not Python to run: shell commands (they need data, GPUs or a
# cluster), configuration files, diagrams and outputs
NOT_EXECUTED = {"bash", "text", "yaml"}


def _hooks():
    spec = importlib.util.spec_from_file_location("torchcal_mkdocs_hooks", DOCS / "mkdocs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _site_sources() -> dict[str, str]:
    """Every Markdown source of the site, by path relative to the repository: the pages under docs/ and the
    files they include, with their text as the site shows it (the includes resolved)."""
    hooks = _hooks()
    sources = {}
    for page in sorted(DOCS.rglob("*.md")):
        text = page.read_text(encoding="utf-8")
        sources[page.relative_to(ROOT).as_posix()] = text
        for match in hooks._INCLUDE.finditer(text):
            path = match.group("path")
            if path.endswith(".md"):
                sources[path] = (ROOT / path).read_text(encoding="utf-8")
    return sources


def _fences(text: str):
    """(info string, body) of each fenced code block."""
    for match in re.finditer(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$", text, re.M | re.S):
        yield match.group("info").strip(), match.group("body")


# ----------------------------------------------------------------------------- the strict build


def test_strict_build_has_no_warning(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert not re.search(r"^(WARNING|ERROR)\b", log, re.M), log
    for page in ("index.html", "metrics.html", "reference/functional.html", "reference/calibrators.html"):
        assert (tmp_path / "site" / page).is_file(), page
    # the API pages hold the docstrings, rendered (an empty page would still build)
    api = (tmp_path / "site" / "reference" / "metrics.html").read_text(encoding="utf-8")
    assert 'id="torchcal.metrics.CalibrationMetrics"' in api and "Accumulates every calibration metric" in api
    # a docstring role became a link to the object's entry
    functional = (tmp_path / "site" / "reference" / "functional.html").read_text(encoding="utf-8")
    assert 'href="metrics.html#torchcal.metrics.CalibrationMetrics"' in functional
    # the home page is the README's quick start
    home = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert 'id="quick-start"' in home and "Streaming over batches" in home


def test_make_test_builds_the_site_strictly_and_installs_its_tools():
    if shutil.which("make") is None:
        pytest.skip("no make here")
    planned = subprocess.run(
        ["make", "-n", "-B", "test"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert "mkdocs build --strict -d site" in planned
    assert planned.index("mkdocs build --strict") < planned.index("pytest")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["docs"]) <= set(extras["dev"])
    assert "site/" in (ROOT / ".gitignore").read_text().split()


# ----------------------------------------------------------------------------- examples are executed


def test_every_code_example_on_the_site_runs_or_is_marked_not_executed():
    """A ```python fence is a doctest (every line an example or its output), so the doctest run executes it,
    or an excerpt of another program titled "(an excerpt: not run)"; any other fence names a language that is
    not run. An unmarked fence is refused rather than skipped."""
    problems = []
    for path, text in _site_sources().items():
        for info, body in _fences(text):
            language = info.split()[0] if info else ""
            if language == "python" and "(an excerpt: not run)" in info:
                continue  # lines to paste into another program, titled as such on the page
            if language == "python":
                if not body.lstrip().startswith(">>> "):
                    problems.append(f"{path}: a python fence that is not a doctest: {body[:60]!r}")
            elif language not in NOT_EXECUTED:
                problems.append(f"{path}: a fence marked {language or 'with nothing'!r}: {body[:60]!r}")
    assert not problems, "\n".join(problems)


def test_every_page_with_examples_is_collected_as_a_doctest():
    """The pages' ```python examples run through pytest's doctest collection (pyproject's testpaths and
    --doctest-glob); this asks pytest itself which files it collects."""
    with_examples = sorted(p for p, text in _site_sources().items() if re.search(r"^>>> ", text, re.M))
    assert {"README.md", "docs/metrics.md", "docs/losses.md", "docs/calibrators.md"} <= set(with_examples)
    # a plain `pytest` (make test) starts from testpaths ...
    testpaths = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["testpaths"]
    outside = [p for p in with_examples if not any(p == t or p.startswith(t.rstrip("/") + "/") for t in testpaths)]
    assert not outside, f"pages with examples outside pytest's testpaths {testpaths}: {outside}"
    # ... and collects a Markdown file as a doctest when it matches a --doctest-glob
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist", "-p", "no:cacheprovider"]
        + with_examples,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    collected = {line.split("::")[0] for line in done.stdout.splitlines() if ".md::" in line}
    missing = [p for p in with_examples if p not in collected]
    assert not missing, f"pages with examples that the test run does not collect: {missing}\n{done.stdout[-2000:]}"


# ----------------------------------------------------------------------------- the include hook


def test_include_selects_a_section_a_prefix_or_the_whole_file(tmp_path, monkeypatch):
    hooks = _hooks()
    monkeypatch.setattr(hooks, "ROOT", tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "notes.md").write_text(
        "# Title\n\nintro [c](docs/conventions.md#bins)\n\n## First\n\none\n\n```bash\n# a comment\n```\n\n"
        "## Second\n\ntwo [s](docs/sub/page.md) [x](https://example.org) [r](other.md) [a](#first)\n"
    )
    page = "guide/page.md"
    first = hooks.include('<!-- include notes.md section="First" -->', page)
    assert first == "## First\n\none\n\n```bash\n# a comment\n```\n"
    head = hooks.include('<!-- include notes.md until="## First" -->', page)
    assert head == "# Title\n\nintro [c](../conventions.md#bins)\n"
    second = hooks.include('<!-- include notes.md section="Second" shift="1" -->', page)
    # headings go one level down, a comment inside a code fence does not; links under docs/ follow the page,
    # absolute links, anchors and links to files the site does not show stay as written
    assert second == "### Second\n\ntwo [s](../sub/page.md) [x](https://example.org) [r](other.md) [a](#first)"
    shifted = hooks.include('<!-- include notes.md section="First" shift="1" -->', page)
    assert "### First" in shifted and "# a comment" in shifted and "## a comment" not in shifted


def test_include_maps_the_readme_and_the_benchmarks_summary_to_their_pages():
    hooks = _hooks()
    text = "[b](benchmarks/results/SUMMARY.md) [f](docs/integrations/timm.md) [d](docs/decisions.md#x)"
    assert hooks.rewrite_links(text, "README.md", "index.md") == (
        "[b](benchmarks.md) [f](integrations/timm.md) [d](decisions.md#x)"
    )
    assert hooks.rewrite_links("[f](../../docs/fidelity.md)", "benchmarks/results/SUMMARY.md", "benchmarks.md") == (
        "[f](fidelity.md)"
    )


def test_include_of_a_missing_file_section_or_heading_fails_the_build(tmp_path, monkeypatch):
    hooks = _hooks()
    monkeypatch.setattr(hooks, "ROOT", tmp_path)
    (tmp_path / "notes.md").write_text("# Title\n\n## First\n")
    with pytest.raises(FileNotFoundError, match="no file missing.md"):
        hooks.include("<!-- include missing.md -->", "index.md")
    with pytest.raises(ValueError, match="no section '## Second'"):
        hooks.include('<!-- include notes.md section="Second" -->', "index.md")
    with pytest.raises(ValueError, match="no line '## Third'"):
        hooks.include('<!-- include notes.md until="## Third" -->', "index.md")
    with pytest.raises(ValueError, match="bad options"):
        hooks.include('<!-- include notes.md sections="First" -->', "index.md")


# ----------------------------------------------------------------------------- docstrings


def test_docstring_roles_become_optional_cross_references():
    hooks = _hooks()
    text = (
        "Calls :func:`ece_from_sums` and :class:`torchcal.metrics.CalibrationMetrics`, see\n"
        ":meth:`~torchcal.metrics.CalibrationMetrics.update` and :mod:`torchcal.functional`.\n\n"
        "    .. math::\n        x = 1\n\n    Example:\n        >>> 1\n        1\n\nthe registry::\n\n    >>> 2\n"
    )
    out = hooks.convert_docstring(text, "torchcal.functional.calibration")
    assert '<autoref identifier="torchcal.functional.calibration.ece_from_sums" optional>' in out
    assert '<autoref identifier="torchcal.metrics.CalibrationMetrics" optional>' in out
    assert (
        '<autoref identifier="torchcal.metrics.CalibrationMetrics.update" optional><code>update</code></autoref>'
        in out
    )
    assert ".. math::" not in out and "        x = 1" in out
    inline = hooks.convert_docstring("Text.\n\n.. math:: a = b\n          + c\n\nMore.", "torchcal.functional")
    assert inline == "Text.\n\n\n    a = b\n          + c\n\nMore."  # an indented (code) block
    assert "    Examples:\n" in out and "the registry:\n" in out
    method = hooks.convert_docstring(":meth:`update`", "torchcal.metrics", "torchcal.metrics.CalibrationMetrics")
    assert 'identifier="torchcal.metrics.CalibrationMetrics.update"' in method


# ----------------------------------------------------------------------------- the guide is complete


def _page(name: str) -> str:
    return (DOCS / name).read_text(encoding="utf-8")


def test_the_guide_names_every_registered_loss_and_calibrator():
    from torchcal.calibrators import list_calibrators
    from torchcal.losses import list_losses

    losses, multilabel, calibrators = _page("losses.md"), _page("multilabel.md"), _page("calibrators.md")
    assert not [n for n in list_losses() if f"`{n}`" not in losses]
    assert not [n for n in list_losses("multilabel") if f'"{n}"' not in multilabel]
    assert not [n for n in list_calibrators() if f"`{n}`" not in calibrators]
    assert not [n for n in list_calibrators("multilabel") if f"`{n}`" not in multilabel]


def test_the_papers_page_names_every_sweep():
    papers = _page("papers.md")
    assert not [p.name for p in sorted((ROOT / "sweeps").glob("*.yaml")) if f"`sweeps/{p.name}`" not in papers]


def test_the_runner_page_describes_every_command():
    """The commands as `torchcal --help` lists them (the CLI's own answer, whatever module defines it)."""
    pytest.importorskip("typer")
    done = subprocess.run(
        [sys.executable, "-m", "torchcal", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**__import__("os").environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"},
    )
    assert done.returncode == 0, done.stderr
    panel = done.stdout[done.stdout.index("Commands") :]
    commands = re.findall(r"^[│|] (\w[\w-]*) {2,}", panel, re.M)
    assert {"train", "evaluate", "report", "arena", "sweep"} <= set(commands), done.stdout
    runner = _page("runner.md")
    assert not [c for c in commands if f"`torchcal {c}" not in runner]


def test_the_readmes_papers_section_names_every_figure():
    """The README's section on the papers' ablations maps each figure of `torchcal figures` to what it needs."""
    pytest.importorskip("matplotlib")
    from torchcal.experiments.reports.figures import FIGURES

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("## The papers' ablations", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in FIGURES if f"`{name}`" not in section]
    assert not missing, f"README's papers section does not name the figures {missing}"


# ----------------------------------------------------------------------------- what the pages say holds


def _user_pages() -> dict[str, str]:
    """The pages a user reads for commands and numbers: the README, the guide and the benchmarks' pages
    (docs/decisions.md records choices and quotes history; it is left out)."""
    paths = [ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
    paths += [ROOT / "benchmarks" / "results" / "SUMMARY.md"]
    paths += sorted(p for p in DOCS.rglob("*.md") if p.name != "decisions.md")
    return {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in paths}


def _command_lines(text: str):
    """Each `torchcal <command> ...` written as code (an inline code span or a line of a bash fence), cut
    at a comment or the next shell command."""
    spans = [m.group(1) for m in re.finditer(r"(?<!`)`([^`]+)`(?!`)", text)]
    bash = [body for info, body in _fences(text) if info.split()[:1] == ["bash"]]
    spans += [line for body in bash for line in body.splitlines()]
    for span in spans:
        for m in re.finditer(r"(?:^|[\s(;])torchcal ([a-z][\w-]*)([^#;|&]*)", span.replace("\\\n", " ")):
            yield m.group(1), m.group(2), span


def test_every_torchcal_command_and_option_the_pages_show_exists():
    """A `torchcal <command> [subcommand] --option` on a page names a command and options the CLI has
    (asked of the CLI's own command tree), so a renamed or removed flag cannot stay in an example."""
    pytest.importorskip("typer")
    import typer

    from torchcal.experiments.cli import app

    root = typer.main.get_command(app)
    problems = []
    for path, text in _user_pages().items():
        for name, rest, span in _command_lines(text):
            command = root.commands.get(name)  # pyright: ignore[reportAttributeAccessIssue]
            if command is None:
                problems.append(f"{path}: no command `torchcal {name}` ({span[:70]!r})")
                continue
            if hasattr(command, "commands"):  # a group: `torchcal config show ...`
                sub = (rest.split() or [""])[0]
                if sub not in command.commands:
                    problems.append(f"{path}: no command `torchcal {name} {sub}` ({span[:70]!r})")
                    continue
                command = command.commands[sub]
            options = {o for p in command.params for o in (*p.opts, *p.secondary_opts)}
            for flag in re.findall(r"(?<![\w-])--[a-z][\w-]*", rest):
                if flag not in options:
                    problems.append(f"{path}: `torchcal {name}` has no option {flag} ({span[:70]!r})")
    assert not problems, "\n".join(problems)


def test_the_readme_names_every_registered_model():
    """The README's list of models (`Models: ...`) is the registry's, as `torchcal list models` prints it."""
    pytest.importorskip("pydantic")
    from torchcal.experiments.models.registry import list_models

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    models = text.split(" Models: ", 1)[1].split("`torchcal list models`", 1)[0]
    named = set(re.findall(r"`(\w+)`", models))
    registered = set(list_models())
    assert named == registered, (sorted(registered - named), sorted(named - registered))


def test_the_readme_arena_tables_are_what_their_generator_writes(tmp_path, monkeypatch):
    """The README's "Which calibrator should I use?" tables, the sentence under each and the list of
    registered calibrators they leave out are exactly what `benchmarks/arena_readme.py --readme-only` writes
    from the committed `benchmarks/results/arena-*/arena.json` (with the command line the section names)."""
    import json

    pytest.importorskip("jinja2")
    spec = importlib.util.spec_from_file_location("arena_readme", ROOT / "benchmarks" / "arena_readme.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"<!-- generated by `([^`]+)`; do not edit by hand -->", readme).group(1)
    sections, ranked = [], set()
    for name, title in (("fashion-mnist", "Fashion-MNIST, the demo's runs"),
                        ("digits", "scikit-learn digits, the demo's grid")):  # fmt: skip
        result = json.loads((ROOT / "benchmarks" / "results" / f"arena-{name}" / "arena.json").read_text())
        sections.append(module.leaderboard(result, title))
        ranked.update(result["calibrators"])
    (tmp_path / "README.md").write_text(readme, encoding="utf-8")
    monkeypatch.setattr(module, "ROOT", tmp_path)
    module.rewrite_readme(sections, command, ranked)
    assert (tmp_path / "README.md").read_text(encoding="utf-8") == readme


def test_the_fidelity_tables_are_the_mean_and_std_of_the_committed_runs():
    """Each row of docs/fidelity.md's tables (method and seven cells) is recomputed here, mean ± sample std
    over the seeds, from the per-run values in `benchmarks/results/fidelity-*-runs.csv`: some group of runs of
    the same loss gives exactly the row's cells at two decimals (the MMCE rows are labelled by their
    normalisation on the page, by the benchmark's labels in the CSV)."""
    import csv
    import statistics

    groups: dict[str, list[dict]] = {}
    for path in sorted((ROOT / "benchmarks" / "results").glob("fidelity-*-runs.csv")):
        with path.open(encoding="utf-8") as f:
            for row in csv.DictReader(f):
                groups.setdefault(f"{path.name}: {row['method']}", []).append(row)

    def cell(rows, key):
        values = [float(r[key]) for r in rows]
        return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"

    def cells(rows):
        return [cell(rows, "error_pre"), cell(rows, "ece_pre"),
                f"{cell(rows, 'ece_ts')} ({cell(rows, 'T_ts')})", cell(rows, "ece_fts"),
                f"{cell(rows, 'adaece_pre')} / {cell(rows, 'adaece_ts')}",
                f"{cell(rows, 'classwise_ece_pre')} / {cell(rows, 'classwise_ece_ts')}",
                f"{cell(rows, 'nll_pre')} / {cell(rows, 'nll_ts')}"]  # fmt: skip

    recomputed = {name: cells(rows) for name, rows in groups.items()}
    problems, checked = [], 0
    for line in _page("fidelity.md").splitlines():
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("| ") or len(row) != 8 or row[0] == "method":
            continue
        checked += 1
        loss = row[0].split()[0]
        same_loss = {n: v for n, v in recomputed.items() if n.split(": ", 1)[1].split()[0] == loss}
        if row[1:] not in same_loss.values():
            problems.append(f"{row[0]}: {row[1:]}; the runs of {loss} give {list(same_loss.values())}")
    assert checked >= 30, checked  # the four tables of the page
    assert not problems, "\n".join(problems)
