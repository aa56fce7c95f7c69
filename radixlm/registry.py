"""A named registry of implementations (attention backends, eviction policies, ...): the one list
that builds them by name and that the command line takes its choices from."""
from __future__ import annotations

import importlib
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}
        # name -> module that registers it when imported (GPU libraries stay unimported until used)
        self._lazy: dict[str, str] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def deco(obj: T) -> T:
            if name in self._items:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._items[name] = obj
            return obj
        return deco

    def register_lazy(self, name: str, module: str) -> None:
        """`name` is registered by importing `module`, which happens on first use."""
        self._lazy[name] = module

    def get(self, name: str) -> T:
        if name not in self._items and name in self._lazy:
            importlib.import_module(self._lazy[name])
        try:
            return self._items[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; choose from {self.names()}") from None

    def names(self) -> list[str]:
        return sorted(set(self._items) | set(self._lazy))

    def __contains__(self, name: str) -> bool:
        return name in self._items or name in self._lazy
