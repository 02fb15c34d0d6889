"""jsonargparse's parse errors in one line, with a "did you mean" for a mistyped key.

Why: jsonargparse explains a typo'd callback argument (``--trainer.callbacks.selectiv=true``) in eleven lines of
union subtypes, under ninety lines of usage, and names neither the argument the class does take nor the option
the user meant. The errors a user makes in a configuration have a few shapes; each is turned into one line that
names the key and, from the keys that exist, the nearest one (:func:`difflib.get_close_matches`):

- ``unrecognized arguments: --data.max_lenght 5`` (a command-line key the parser does not know);
- ``Subcommand 'fit' does not accept option 'model.lerning_rate'`` (a key in a config file);
- ``Parser key "trainer.callbacks": ... Problem with given class_path 'C': Option 'selectiv' is not accepted``
  (an argument a class given by ``class_path`` does not take, on the command line or in a file; a field of TRL's
  ``GRPOConfig`` / ``RLOOConfig`` that GRPOModule / RLOOModule do not take gets their reason instead);
- ``Parser key "K": ... module 'M' has no attribute 'N'`` (a ``class_path`` naming no class);
- ``Parser key "K": Expected a <class 'int'>. Got value: abc`` (a value of the wrong type).

Anything else keeps jsonargparse's words, its lines joined into one.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from argparse import ArgumentParser
from collections.abc import Iterable

__all__ = ["did_you_mean", "explain_parse_error", "parser_keys"]

_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<args>.*)", re.DOTALL)
_NOT_ACCEPTED_KEY = re.compile(r"(?:Subcommand|Group) '[^']*' does not accept option '(?P<key>[^']+)'")
_PARSER_KEY = re.compile(r'Parser key "(?P<key>[^"]+)":')
_CLASS_PROBLEM = re.compile(r"Problem with given class_path '(?P<class_path>[^']+)':\s*\n\s*(?P<reason>[^\n]+)")
_OPTION_NOT_ACCEPTED = re.compile(r"Option '(?P<option>[^']+)' is not accepted")
_NO_ATTRIBUTE = re.compile(r"module '(?P<module>[^']+)' has no attribute '(?P<name>[^']+)'")
_WRONG_TYPE = re.compile(r"Expected a <class '(?P<type>[^']+)'>\. Got value: (?P<value>[^\n]*)")
_JSONARGPARSE_HEADINGS = ("Does not validate against any of the Union subtypes", "Subtypes:", "Errors:", "Given value")


def did_you_mean(word: str, candidates: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the candidate nearest ``word``, or an empty string when none is near."""
    match = difflib.get_close_matches(word, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def parser_keys(*parsers: ArgumentParser) -> set[str]:
    """The keys of ``parsers``' options (``data.max_length`` for ``--data.max_length``)."""
    return {
        option[2:] for parser in parsers for action in parser._actions for option in action.option_strings
        if option.startswith("--")
    }  # fmt: skip


def explain_parse_error(message: str, keys: Iterable[str]) -> str:
    """One line for jsonargparse's parse error ``message``; ``keys`` are the parser's keys (``data.max_length``,
    ``trainer.callbacks``, ...), the candidates for a mistyped one.

    Example:
        >>> explain_parse_error("unrecognized arguments: --data.max_lenght 5", ["data.max_length"])
        "unknown option --data.max_lenght (did you mean '--data.max_length'?)"
    """
    keys = list(keys)
    unrecognized = _UNRECOGNIZED.match(message)
    if unrecognized:
        options = [arg for arg in unrecognized["args"].split() if arg.startswith("--")]
        if options:
            option = options[0].split("=", 1)[0]
            return f"unknown option {option}{did_you_mean(option, [f'--{key}' for key in keys])}"
    not_accepted = _NOT_ACCEPTED_KEY.search(message)
    if not_accepted:
        key = not_accepted["key"]
        return f"unknown key {key!r} in the configuration{did_you_mean(key, keys)}"
    parser_key = _PARSER_KEY.match(message)
    if parser_key:
        return f"{parser_key['key']}: {_explain_value_problem(message[parser_key.end():])}"
    return _joined(message)


def _explain_value_problem(text: str) -> str:
    """What jsonargparse found wrong with one key's value, in a few words."""
    problem = _CLASS_PROBLEM.search(text)
    if problem:
        class_path, reason = problem["class_path"], problem["reason"].strip()
        option = _OPTION_NOT_ACCEPTED.search(reason)
        if option:
            name = option["option"]
            refusal = _trl_field_refusal(class_path, name)
            if refusal:
                return refusal
            return f"{class_path} takes no argument {name!r}{did_you_mean(name, _init_arguments(class_path))}"
        missing = _NO_ATTRIBUTE.search(reason)
        if missing:
            module, name = missing["module"], missing["name"]
            return f"{module} has no {name!r}{did_you_mean(name, _public_names(module))}"
        return f"{class_path}: {reason}"
    wrong_type = _WRONG_TYPE.search(text)
    if wrong_type:
        return f"expected {wrong_type['type'].rsplit('.', 1)[-1]}, got {wrong_type['value'].strip()!r}"
    lines = [line.strip(" -") for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith(_JSONARGPARSE_HEADINGS)]
    return lines[0] if lines else _joined(text)


def _trl_field_refusal(class_path: str, name: str) -> str | None:
    """What GRPOModule / RLOOModule say of TRL's field ``name`` they do not take (its new name, or why not); None
    for another class or a name TRL does not have."""
    from lit_memtrain.objectives.grpo import GRPOModule
    from lit_memtrain.objectives.trl_config_fields import refuse_trl_fields

    module, _, class_name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), class_name)
    except (ImportError, AttributeError, ValueError):
        return None
    if not (isinstance(cls, type) and issubclass(cls, GRPOModule)):
        return None
    try:
        refuse_trl_fields(cls.__name__, {name: True})
    except ValueError as error:
        return str(error)
    return None


def _init_arguments(class_path: str) -> list[str]:
    """The keyword arguments ``class_path``'s constructor takes (none when it cannot be imported)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        parameters = inspect.signature(cls).parameters.values()
    except (ImportError, AttributeError, TypeError, ValueError):
        return []
    return [p.name for p in parameters if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _public_names(module: str) -> list[str]:
    try:
        return [name for name in dir(importlib.import_module(module)) if not name.startswith("_")]
    except ImportError:
        return []


def _joined(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())
