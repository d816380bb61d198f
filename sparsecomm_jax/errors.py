"""Errors that name the argument they are about.

A library function that refuses the value of one of its arguments raises
``ArgumentError``: a ``ValueError`` that carries the argument's name and value, and a
message that may mention other arguments by name. Python shows it in Python's words
(``comm_dtype='bfloat16' needs table_update='rows'``); a command line shows the same
error in its own flags (``--comm-dtype bfloat16 needs --table-update rows``) from the
names and values alone (``render``), never by reading the message.

Example:
    >>> from sparsecomm_jax.errors import ArgumentError
    >>> e = ArgumentError("comm_dtype", "bfloat16", "needs $table_update", table_update="rows")
    >>> str(e)
    "comm_dtype='bfloat16' needs table_update='rows'"
    >>> e.render(lambda name, value: f"--{name.replace('_', '-')} {value}")
    '--comm-dtype bfloat16 needs --table-update rows'
"""

from __future__ import annotations

import string
from collections.abc import Callable
from typing import Any, NamedTuple

Words = Callable[[str, Any], str]  # (argument, value) -> how an interface says it


class _NoValue:
    """The value of an ``ArgumentError`` that names its argument alone (its problem
    says what was given: ``loss_fn must be callable, got NoneType``)."""

    def __repr__(self) -> str:
        return "NO_VALUE"


NO_VALUE = _NoValue()


class Call(NamedTuple):
    """A remedy that is a call in Python and an argument elsewhere: a command line
    makes the call itself from one of its flags (``--devices`` simulates devices).

    Attributes:
      function: the function to call, e.g. ``"runtime.simulate_cpu_devices"``.
      argument: the library argument whose value the call takes (``"num_devices"``).
      value: the value to call it with.
    """

    function: str
    argument: str
    value: Any


def clipped(text: str, most: int = 80) -> str:
    """``text`` cut after ``most`` characters (``...`` says so): a value a user gave is
    echoed in an error, never 100 KB of it.

    Example:
        >>> clipped("x" * 100, 10)
        'xxxxxxx...'
    """
    return text if len(text) <= most else text[: most - 3] + "..."


def python_words(argument: str, value: Any) -> str:
    """An argument as a Python call passes it: ``table_update='rows'`` (a long list cut
    short by ``few``, a long value by ``clipped``; ``NO_VALUE``: the name alone; a
    ``Call``: the call to make)."""
    if value is NO_VALUE:
        return argument
    if isinstance(value, Call):
        return f"call {value.function}({value.value!r})"
    if isinstance(value, list | tuple | set | frozenset) and len(value) > 8:
        return f"{argument}={few(value)}"
    return f"{argument}={clipped(repr(value))}"


class ArgumentError(ValueError):
    """A refused argument value.

    Attributes:
      argument: the parameter's name (``"density"``, ``"num_devices"``, ...).
      value: the value given (``NO_VALUE``: the message names the argument alone).
      problem: what is wrong and what to pass instead, after the argument; other
        arguments it names are ``$name`` placeholders filled from ``mentions``.
      mentions: the other arguments the problem names, with the values it names
        (``table_update="rows"``).
    """

    def __init__(self, argument: str, value: Any, problem: str, **mentions: Any):
        self.argument, self.value, self.problem, self.mentions = argument, value, problem, mentions
        super().__init__(self.render(python_words))

    def render(self, words: Words) -> str:
        """The message, each argument said by ``words(argument, value)``."""
        said = {name: words(name, value) for name, value in self.mentions.items()}
        problem = string.Template(self.problem).safe_substitute(said)
        return f"{words(self.argument, self.value)} {problem}"

    def __reduce__(self):  # picklable, e.g. across processes
        return _rebuild, (self.argument, self.value, self.problem, self.mentions)


def few(names: Any, most: int = 8) -> str:
    """Names for a message, cut after ``most``: a message stays one readable line
    however many names there are.

    Example:
        >>> few([f"t{i}" for i in range(2000)], most=2)
        "['t0', 't1'] and 1,998 more"
    """
    names = list(names)
    if len(names) <= most:
        return repr(names)
    return f"{names[:most]!r} and {len(names) - most:,} more"


def _rebuild(argument: str, value: Any, problem: str, mentions: dict) -> ArgumentError:
    return ArgumentError(argument, value, problem, **mentions)
