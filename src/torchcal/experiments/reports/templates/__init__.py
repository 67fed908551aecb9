"""The HTML reports' Jinja2 templates (``*.html.j2`` beside this file), rendered with autoescaping: every
value a template shows is escaped unless the code marks it as markup (figures' data URLs are attributes)."""

from __future__ import annotations

import functools
from pathlib import Path

__all__ = ["render"]

_HERE = Path(__file__).parent


@functools.cache
def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(_HERE),
        autoescape=True,
        undefined=jinja2.StrictUndefined,  # a name the code did not pass is an error, not an empty string
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )


def render(template: str, **context) -> str:
    """The template ``template`` (a file of this folder) rendered with ``context``."""
    return _environment().get_template(template).render(**context)
