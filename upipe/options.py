"""The constructor options a method offers to whoever configures it from outside Python.

A method's constructor takes keyword options of its own beyond the common signature of
:class:`upipe.module.ContextParallelAttention` (UPipe's ``heads_per_stage``, FPDT's
``chunk_size``). A method lists those a configuration may set in its class attribute
``declared_options``, one :class:`MethodOption` each: the name, the kind of value, one line of
help and a short tag. Everything outside the method (a benchmark cell, its command-line flags,
its row and its id) reads them from there, so a new option of one method is written in that
method alone (docs/design.md#one-interface-for-every-method).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MethodOption:
    """One keyword option of a method's constructor that a configuration may set.

    ``kind`` is ``bool``, ``int`` or ``str``; ``tokens`` marks an ``int`` that counts tokens
    (written 64K on a command line or in a declaration); ``choices`` limits a ``str``. ``tag``
    is the short mark of a set value in names and tables: ``U`` makes ``U8``, ``c`` makes
    ``c64K``, and a ``bool`` tagged ``ov`` makes ``ov`` for True and ``noov`` for False.
    ``help`` says what the option does, for command-line help, and ``unset`` what the method
    does when it is not set, where its constructor's default is None (a default of a value
    is read from the constructor, so that no text can drift from it).
    """

    name: str
    kind: type
    help: str
    tag: str
    tokens: bool = False
    choices: tuple[str, ...] = ()
    unset: str = ""

    def check(self, value, method: str) -> None:
        """Raise ValueError naming the option and its rule unless ``value`` is of its kind
        (bool is not an int here: ``heads_per_stage=True`` is a mistake, not 1)."""
        ok = type(value) is self.kind if self.kind is not int else (
            isinstance(value, int) and not isinstance(value, bool))
        if ok and self.choices:
            ok = value in self.choices
        if not ok:
            want = (f"one of {list(self.choices)}" if self.choices
                    else {bool: "true or false", int: "an integer"}.get(self.kind, "text"))
            raise ValueError(f"{self.name} of {method!r} must be {want}, got {value!r}")
