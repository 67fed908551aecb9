"""The HTML report in a real browser (headless Chromium): with the demo's nine methods, in the demo's
columns and in the widest column set (three OOD sets), the page fits a laptop's 1280-pixel window and a narrow
800-pixel one, with no horizontal page scroll; at 1280 the demo's table fits without its scroller. Skipped only where no Chromium is
installed (CI installs Debian's chromium: .ci/run)."""

import dataclasses
import re
import shutil
import subprocess

import pytest

from torchcal.experiments.config import load_config
from torchcal.experiments.evaluation.evaluate import collect_groups, evaluate_run
from torchcal.experiments.reports.html import html_report
from torchcal.experiments.training.loop import train

BROWSER = next((b for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)

# after load: the page's width against the window's, the table box's width against its content's, and the
# elements that stick out on the right
MEASURE = """<script>window.addEventListener("load", () => {
  const page = document.documentElement, box = document.querySelector("table").parentElement;
  const out = [...document.querySelectorAll("body *")].filter(e => e.getBoundingClientRect().right >
    window.innerWidth + 0.5).slice(0, 5).map(e => e.tagName + "." + e.className);
  document.body.setAttribute("data-fit", [page.scrollWidth, window.innerWidth, box.scrollWidth,
    box.clientWidth].join(" ") + " " + out.join(","));
});</script>"""

LOSSES = ("ce", "ls-0.05", "brier", "mmce", "fl-3", "flsd-53", "dfl", "adafocal", "fcl")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Two reports of nine rows of three runs each, from one tiny real run (its figures are real), with the
    CIFAR presets' longest labels: the demo's columns (one OOD set), and the widest set (three OOD sets)."""
    root = tmp_path_factory.mktemp("layout")
    cfg = ["data.name=digits", "data.ood.sets=[]", "data.val_size=260", "model.width=8", "train.epochs=1",
           "train.num_threads=1"]  # fmt: skip
    train(load_config(None, cfg), root / "run")
    evaluate_run(root / "run", ("ts",))
    (group,) = collect_groups([root / "run"], "ts")
    stats = {k: (v[0], 0.42, 3) for k, v in group.stats.items()}
    columns = {
        "demo": {f"ood auroc {w}": (91.23, 1.05, 3) for w in ("pre", "post")},
        "widest": {f"ood auroc {s} {w}": (91.23, 1.05, 3) for s in ("svhn", "cifar10c", "cifar100")
                   for w in ("pre", "post")},
    }  # fmt: skip
    pages = {}
    for name, extra in columns.items():
        groups = [
            dataclasses.replace(group, label=f"cifar10 · resnet110_he · {loss}", runs=[root / "run"] * 3,
                                results=group.results * 3, seeds=[0, 1, 2], stats=stats | extra)
            for loss in LOSSES
        ]  # fmt: skip
        page = html_report([], root / name, "ts", note="over-confident regime: " + "x " * 80, groups=groups)
        pages[name] = root / f"{name}-measured.html"
        pages[name].write_text(page.read_text().replace("</body>", MEASURE + "</body>"))
    return pages


def fit(page, width, profile):
    out = subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
         f"--window-size={width},800", "--virtual-time-budget=5000", "--dump-dom", page.as_uri()],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = re.search(r'data-fit="(\d+) (\d+) (\d+) (\d+) ?([^"]*)"', out.stdout)
    assert found, out.stderr[-2000:]
    page_width, window, table_width, box_width = map(int, found.groups()[:4])
    return page_width, window, table_width, box_width, found.group(5)


@pytest.mark.skipif(BROWSER is None, reason="no Chromium installed (CI installs Debian's chromium)")
@pytest.mark.parametrize("columns", ["demo", "widest"])
@pytest.mark.parametrize("width", [1280, 800])
def test_report_fits_the_window(reports, tmp_path, columns, width):
    page_width, window, table_width, box_width, sticking_out = fit(reports[columns], width, tmp_path / "p")
    assert page_width <= window, f"the page is {page_width} px wide in a {window} px window: {sticking_out}"
    if (columns, width) == ("demo", 1280):  # a laptop: the demo's table needs no scrolling at all
        assert table_width <= box_width, f"table {table_width} px in a {box_width} px box"
    else:  # wider tables scroll inside their box
        assert box_width < window
