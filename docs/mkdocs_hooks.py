"""The site's build helpers: an MkDocs hook that includes files kept outside ``docs/``, and a griffe
extension that renders the docstrings' reStructuredText roles.

Pages of the site that show a file kept outside ``docs/`` (the README, the benchmarks' summary) include it
rather than copy it.

A line ``<!-- include PATH -->`` in a page is replaced by the file PATH (relative to the repository root);
``<!-- include PATH section="TITLE" -->`` by its level-2 section TITLE (the ``## TITLE`` line up to the next
level-2 heading); ``<!-- include PATH until="HEADING" -->`` by the file up to the line HEADING; ``shift="1"``
makes each heading of the included text one level deeper (outside code fences). Relative
links of the included text are rewritten from the file's place in the repository to the page's place in the
site: a file under ``docs/`` becomes its page, an included file becomes the page that includes it
(``SITE_PAGES``). A link to anything else is left as it is, so that ``mkdocs build --strict`` names it.
An include whose file, section or heading is missing raises an error naming it: the build fails.

The docstrings are Google style with a few reStructuredText habits (SPEC's style guide): ``:func:`name```
roles, ``.. math::`` blocks and ``Example:`` headings. :class:`DocstringRoles` (a griffe extension, named in
``mkdocs.yml``) turns a role into a link to the object's entry when the site documents it (an optional
cross-reference: code without a link otherwise), a math block into a code block, and ``Example:`` into the
``Examples:`` section griffe renders as code.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

try:  # present wherever mkdocstrings is; the hook and its tests need only the standard library
    from griffe import Extension
except ImportError:  # pragma: no cover
    Extension = object

ROOT = Path(__file__).resolve().parent.parent

# files outside docs/ shown on a page of the site: repository path -> page (relative to docs/)
SITE_PAGES = {
    "README.md": "index.md",
    "benchmarks/results/SUMMARY.md": "benchmarks.md",
    "benchmarks/README.md": "benchmarks.md",
}

_INCLUDE = re.compile(r'^<!-- include (?P<path>\S+)(?P<options>(?: \w+="[^"]+")*) -->$', re.M)
_OPTION = re.compile(r' (\w+)="([^"]+)"')
_FENCE = re.compile(r"^(```|~~~)")
_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def _shift_headings(text: str, levels: int) -> str:
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            line = "#" * levels + line
        out.append(line)
    return "\n".join(out)


def _select(text: str, path: str, key: str | None, value: str | None) -> str:
    lines = text.splitlines()
    if key is None:
        return text
    if key == "until":
        if value not in lines:
            raise ValueError(f"include: {path} has no line {value!r}")
        return "\n".join(lines[: lines.index(value)])
    heading = f"## {value}"
    if heading not in lines:
        raise ValueError(f"include: {path} has no section {heading!r}")
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start:end])


def rewrite_links(text: str, source: str, page: str) -> str:
    """Rewrites the relative links of ``text``, written in the repository file ``source``, for the page
    ``page`` (relative to docs/)."""
    page_dir = posixpath.dirname(page)

    def replace(match: re.Match) -> str:
        target = match.group("target")
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return match.group(0)
        path, _, anchor = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(source), path))
        if repo_path.startswith("docs/"):
            site_path = repo_path[len("docs/") :]
        elif repo_path in SITE_PAGES:
            site_path = SITE_PAGES[repo_path]
        else:
            return match.group(0)
        new = posixpath.relpath(site_path, page_dir or ".")
        return f"]({new}{'#' + anchor if anchor else ''})"

    return _LINK.sub(replace, text)


def include(markdown: str, page: str) -> str:
    """``markdown`` of the page ``page`` (relative to docs/) with its include lines replaced."""

    def replace(match: re.Match) -> str:
        path = match.group("path")
        file = ROOT / path
        if not file.is_file():
            raise FileNotFoundError(f"include: no file {path} (in docs/{page})")
        options = dict(_OPTION.findall(match.group("options")))
        unknown = set(options) - {"section", "until", "shift"}
        if unknown or {"section", "until"} <= set(options):
            raise ValueError(f"include: bad options {sorted(options)} (in docs/{page}): section or until, and shift")
        key = next((k for k in ("section", "until") if k in options), None)
        text = _select(file.read_text(encoding="utf-8"), path, key, options.get(key))
        if "shift" in options:
            text = _shift_headings(text, int(options["shift"]))
        return rewrite_links(text, path, page)

    return _INCLUDE.sub(replace, markdown)


def on_page_markdown(markdown, page, config, files):  # noqa: ARG001  (MkDocs' hook signature)
    return include(markdown, page.file.src_uri)


# ----------------------------------------------------------------------------- docstrings (griffe)

_ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|attr|mod|data|exc|obj):`(?P<tilde>~?)(?P<name>[\w.]+)(?:\(\))?`")
_MATH = re.compile(r"^(?P<indent>[ \t]*)\.\. math::[ \t]*\n", re.M)
_INLINE_MATH = re.compile(r"^(?P<indent>[ \t]*)\.\. math:: (?P<formula>\S.*)$", re.M)
_EXAMPLE = re.compile(r"^(?P<indent>[ \t]*)Example:[ \t]*$", re.M)
_LITERAL = re.compile(r"(?<=\w)::[ \t]*$", re.M)  # "text::" before an indented block


def convert_docstring(text: str, module: str, parent: str | None = None) -> str:
    """``text`` with reStructuredText roles as optional cross-references, math blocks as code blocks and
    ``Example:`` as ``Examples:``. A name without a dot is looked up in ``parent`` (a method) or ``module``."""

    def role(match: re.Match) -> str:
        name = match.group("name")
        if name.startswith("torchcal."):
            identifier = name
        elif "." in name or match.group("role") == "meth" and parent:
            identifier = f"{parent or module}.{name}" if match.group("role") == "meth" else f"{module}.{name}"
        else:
            identifier = f"{module}.{name}"
        shown = name.rsplit(".", 1)[-1] if match.group("tilde") else name
        return f'<autoref identifier="{identifier}" optional><code>{shown}</code></autoref>'

    text = _ROLE.sub(role, text)
    text = _MATH.sub("", text)
    text = _INLINE_MATH.sub(lambda m: f"\n{m.group('indent')}    {m.group('formula')}", text)
    text = _EXAMPLE.sub(r"\g<indent>Examples:", text)
    return _LITERAL.sub(":", text)


class DocstringRoles(Extension):
    """Griffe extension: :func:`convert_docstring` on every docstring the handler loads."""

    def on_instance(self, *, obj, **kwargs):  # noqa: ARG002  (griffe's event signature)
        if obj.docstring is None:
            return
        module = obj.module.path if not obj.is_module else obj.path
        parent = obj.parent.path if obj.parent is not None and obj.parent.is_class else None
        obj.docstring.value = convert_docstring(obj.docstring.value, module, parent)
