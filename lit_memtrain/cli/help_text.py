"""``--help`` in plain words: the Sphinx markup of the docstrings jsonargparse reads, removed.

Why: jsonargparse writes each argument's help from its class's docstring, written for the API reference:
``:class:`~lightning.pytorch.core.LightningModule```, ``Default: ``"auto"``.``, `` `subclass <https://...>`_ ``.
A terminal shows that markup as it is; the help of ``lit-memtrain fit`` shows the words it stands for.
"""

from __future__ import annotations

import re

from jsonargparse import DefaultHelpFormatter

__all__ = ["PlainHelpFormatter", "plain_text"]

_ROLE = re.compile(r":(?:py:)?[a-z]+:`(?P<target>[^`]+)`")
_LINK = re.compile(r"`(?P<words>[^`<]+?)\s*<(?P<address>[^>]+)>`_{1,2}")
_LITERAL = re.compile(r"``(?P<text>[^`]+)``")


def _role_words(match: re.Match[str]) -> str:
    """``:class:`~a.b.C``` -> ``C``; ``:ref:`the docs <label>``` -> ``the docs``; ``:func:`a.b``` -> ``a.b``."""
    target = match["target"]
    if target.endswith(">") and "<" in target:
        return target[: target.index("<")].strip()
    if target.startswith("~"):
        return target[1:].rsplit(".", 1)[-1]
    return target


def plain_text(text: str) -> str:
    """``text`` without Sphinx roles, literals and links (a link keeps its address, in brackets).

    Example:
        >>> plain_text("An optional :class:`~lightning.pytorch.core.LightningModule` class. Default: ``\\"auto\\"``.")
        'An optional LightningModule class. Default: "auto".'
    """
    text = _ROLE.sub(_role_words, text)
    text = _LINK.sub(lambda match: f"{match['words']} ({match['address']})", text)
    return _LITERAL.sub(lambda match: match["text"], text)


class PlainHelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter (types, defaults) over :func:`plain_text`: argument help and descriptions
    both pass through ``_split_lines`` or ``_fill_text``, argparse's two points where text is wrapped."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        return super()._split_lines(plain_text(text), width)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return super()._fill_text(plain_text(text), width, indent)
