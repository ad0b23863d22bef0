"""What a request's output must match: a JSON schema, a regular expression, a choice of strings or a
grammar (constrained decoding). This is the request's statement only; ``engine/structured`` compiles
it into a grammar whose token masks shape every row the request samples or verifies."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

Kind = Literal["json", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredOutput:
    """``kind`` and its ``spec``:

    - ``json``: a JSON schema as JSON text (``{"type": "object"}`` for OpenAI's ``json_object``);
    - ``regex``: a regular expression the whole output matches;
    - ``choice``: a JSON list of strings, the output being exactly one of them;
    - ``grammar``: a Lark grammar (GBNF, with ``::=`` rules, is converted to Lark).

    ``param`` names the request field it came from, so that an invalid one is refused by name.
    """

    kind: Kind
    spec: str
    whitespace_pattern: str | None = None  # json only: the whitespace allowed between tokens
    param: str = "structured_outputs"

    @classmethod
    def json_schema(cls, schema: dict | bool, param: str, whitespace_pattern: str | None = None) -> StructuredOutput:
        # Key order is kept: a schema's property order is the order the output writes them in.
        return cls("json", json.dumps(schema, separators=(",", ":")), whitespace_pattern, param)

    @classmethod
    def choice(cls, options: list[str], param: str) -> StructuredOutput:
        return cls("choice", json.dumps(list(options)), None, param)

    @property
    def key(self) -> tuple[str, str, str | None]:
        """What identifies the compiled grammar (the field it came from does not)."""
        return (self.kind, self.spec, self.whitespace_pattern)
