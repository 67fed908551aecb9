"""Public namespaces list their public names only: ``dir()`` (and so tab completion) of a torchcal module
shows its ``__all__`` and its public submodules, not the names it imports for its own use (``torch``,
``json``, ``annotations``, ...), through the module-level ``__dir__`` of PEP 562. A leaf module."""

from __future__ import annotations

import sys
import types

__all__ = ["only_public"]


def only_public(module_name: str) -> None:
    """Gives module ``module_name`` (imported, with an ``__all__``) a ``__dir__`` that lists ``__all__`` and
    the public submodules imported at the time of the call."""
    module = sys.modules[module_name]

    def __dir__():
        namespace = vars(module)
        submodules = {
            name
            for name, value in namespace.items()
            if isinstance(value, types.ModuleType)
            and value.__name__ == f"{module_name}.{name}"
            and not name.startswith("_")
        }
        return sorted(set(namespace["__all__"]) | submodules)

    module.__dir__ = __dir__
