"""Reports over groups of runs: Markdown/CSV tables, the HTML report (Jinja2 templates) and Grad-CAM figures."""

from __future__ import annotations
