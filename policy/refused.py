"""The one shape every refusal takes: a snake_case ``kind`` saying which no it is.

The HTTP layer maps kinds to statuses (``wire.REFUSALS``) and the UI to messages, so a
refusal is caught by its kind, never by parsing its text. The offending values ride along
as attributes (``fields`` keeps them together), so a caller can say what was wrong.
"""

from __future__ import annotations


class Refused(Exception):
    """``Refused(kind, message, **fields)``; a subclass that sets ``KINDS`` may carry only those.

    Subclasses also derive from the builtin that fits (``ValueError`` for bad input,
    ``RuntimeError`` for a state that cannot serve), so plain ``except`` clauses keep working.
    """

    KINDS: tuple[str, ...] = ()

    def __init__(self, kind: str, message: str, **fields: object) -> None:
        assert not self.KINDS or kind in self.KINDS, kind
        super().__init__(message)
        self.kind = kind
        self.fields = fields
        for name, value in fields.items():
            setattr(self, name, value)
