"""A name -> function table: one instance per concept (advantage estimators, policy losses,
reductions, KL estimators).

A YAML value (a ``Literal`` field of ``AlgorithmConfig``) selects an entry; a test checks
that every registry's names equal its ``Literal``'s values, so a name can neither be
accepted by the config and missing here nor registered here and unreachable from YAML.
Plug-ins may ``register`` new entries; to select them from YAML the ``Literal`` must grow too.
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Functions of one concept, keyed by the name the config uses."""

    def __init__(self, concept: str):
        self.concept = concept
        self._entries: dict[str, F] = {}

    def register(self, *names: str) -> Callable[[F], F]:
        """Decorator: ``@REGISTRY.register("name", "alias")`` adds the function under each name."""

        def add(fn: F) -> F:
            for name in names:
                if name in self._entries:
                    raise ValueError(f"{self.concept} {name!r} is already registered")
                self._entries[name] = fn
            return fn

        return add

    def get(self, name: str) -> F:
        """The function registered as ``name``; ValueError naming the valid choices otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.concept} {name!r}; registered: {', '.join(self.names())}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.concept!r}, {list(self._entries)})"
