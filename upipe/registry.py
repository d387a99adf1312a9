"""Method registry: name -> CP attention class.

UPipe registers itself on import; baselines register through the ``upipe.methods`` entry-point
group (pyproject.toml), loaded lazily on the first lookup, so ``upipe`` never imports
``baselines`` statically (docs/design.md#layout-and-dependency-direction).
"""

from __future__ import annotations

from importlib.metadata import entry_points

_REGISTRY: dict[str, type] = {}
_entry_points_loaded = False


def register_method(name: str):
    """Class decorator: make ``cls`` available as ``name`` to the runner and CLI."""

    def deco(cls):
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"method name {name!r} is already registered to {_REGISTRY[name]}")
        _REGISTRY[name] = cls
        cls.registry_name = name
        return cls

    return deco


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True
    for ep in entry_points(group="upipe.methods"):
        if ep.name not in _REGISTRY:
            _REGISTRY[ep.name] = ep.load()


def available_methods() -> list[str]:
    """Every registered method name, sorted."""
    _load_entry_points()
    return sorted(_REGISTRY)


def get_method(name: str) -> type:
    """The class registered as ``name``; ``ValueError`` listing the valid names otherwise."""
    _load_entry_points()
    if name not in _REGISTRY:
        raise ValueError(f"method must be one of {sorted(_REGISTRY)}, got {name!r}")
    return _REGISTRY[name]


def build_method(name: str, *args, **kwargs):
    """Instantiate the method registered as ``name`` with the common constructor."""
    return get_method(name)(*args, **kwargs)
