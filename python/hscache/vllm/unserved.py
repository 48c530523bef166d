"""vLLM's own bookkeeping methods, refused on hscache's read-through views.

hscache hands vLLM code objects that look like vLLM's (the coordinator and single-type
manager views are even instances of vLLM's classes; the free queue and the prefix-cache
index are views of the core). A vLLM method such a view does not serve would run
vLLM's Python over it (blocks taken from the pool behind the core's tables) or fail
half-way with an ``AttributeError``. Each one is replaced by a stand-in that raises
``UnsupportedError`` naming the method and what to call instead, before anything changes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import Any


def refused(owner: str, name: str, instead: str) -> Any:
    """A stand-in for vLLM's ``owner.name`` that raises ``UnsupportedError``."""

    def stand_in(self: Any, *args: Any, **kwargs: Any) -> Any:
        from hscache.exceptions import UnsupportedError

        raise UnsupportedError(
            f"{owner}.{name} is vLLM's own bookkeeping and does not run on hscache's view "
            f"of it; {instead}"
        )

    stand_in.__name__ = stand_in.__qualname__ = name
    return stand_in


def unserved_methods(view: type, vllm_cls: type, keep: Iterable[str] = ()) -> list[str]:
    """The methods ``vllm_cls`` defines (its bases' included, dunders excluded) that
    ``view`` does not, less ``keep`` (read-only ones safe to inherit)."""
    served = {n for k in view.__mro__ for n in vars(k)} | set(keep)
    names: list[str] = []
    for k in vllm_cls.__mro__:
        for attr, value in vars(k).items():
            if inspect.isfunction(value) and not attr.startswith("__") and attr not in served:
                if attr not in names:
                    names.append(attr)
    return names


def refuse_unserved(vllm_cls: type, instead: str) -> Any:
    """Class decorator: the view refuses every method of ``vllm_cls`` it does not define."""

    def apply(view: type) -> type:
        for name in unserved_methods(view, vllm_cls):
            setattr(view, name, refused(vllm_cls.__name__, name, instead))
        return view

    return apply
