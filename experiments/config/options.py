"""The methods' own options as the harness reads them: from each method's ``declared_options``
(``upipe.options``), never from a list of its own (docs/design.md#one-interface-for-every-method).

A cell carries one ``options`` mapping; its flags (``cli_args``), its id and label, its row and
search summary, and the planner read the options' names, kinds, tags and defaults from here.
"""

from __future__ import annotations

import inspect

from experiments.config.sizes import format_size
from upipe.options import MethodOption
from upipe.registry import available_methods, get_method

# Options that were fields of the cell when the first results were committed. Every row and
# search summary carries them as columns (null where unset) at the places those files have
# them, and a cell's id hashes heads_per_stage even unset, as it did: so results written before
# and after the options became one mapping are the same files. Options declared later are
# columns where set and enter the id only when set.
COMMITTED_COLUMNS = ("heads_per_stage", "chunk_size", "overlap")
HASHED_UNSET = ("heads_per_stage",)


def declared(method: str) -> dict[str, MethodOption]:
    """name -> declaration of every option ``method`` takes, in the order it lists them."""
    return {o.name: o for o in get_method(method).declared_options}


def every_option() -> dict[str, dict[str, MethodOption]]:
    """name -> {method: its declaration} over the registered methods, in registry order (what
    the command line offers, one flag per name)."""
    out: dict[str, dict[str, MethodOption]] = {}
    for method in available_methods():
        for name, opt in declared(method).items():
            out.setdefault(name, {})[method] = opt
    return out


def token_options() -> frozenset[str]:
    """Names of the options some method counts in tokens (written "64K" in a declaration)."""
    return frozenset(n for n, by in every_option().items() if any(o.tokens for o in by.values()))


def number_options() -> tuple[str, ...]:
    """Names of the options every method that declares them takes as an integer: a row's
    value for one is a number or null."""
    return tuple(n for n, by in every_option().items() if all(o.kind is int for o in by.values()))


def default(method: str, name: str):
    """What ``method``'s constructor takes for option ``name`` when it is not set."""
    return inspect.signature(get_method(method)).parameters[name].default


def mark(opt: MethodOption, value) -> str:
    """A set value's short mark in a cell's id and label: ``U8``, ``c64K``, ``ov``, ``noov``."""
    if opt.kind is bool:
        return opt.tag if value else f"no{opt.tag}"
    return f"{opt.tag}{format_size(value) if opt.tokens else value}"


def check(method: str, options: dict) -> None:
    """Raise ValueError naming the option and the rule unless every one of ``options`` is
    declared by ``method`` and of its kind (the method's ``check_config`` checks the rest)."""
    own = declared(method)
    for name, value in options.items():
        if name not in own:
            takers = [m for m, _ in every_option().get(name, {}).items()]
            where = (f"applies to {', '.join(takers)} only" if takers
                     else "is no option of any registered method")
            raise ValueError(f"{name} {where}, not {method!r} (its options: "
                             f"{', '.join(own) or 'none'})")
        own[name].check(value, method)
