"""A record kept as one JSON document of its dataclass's fields: a SQLite column, a Redis value."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Self


class JsonRecord:
    """Mixed into a dataclass: ``doc()`` writes its fields as JSON, ``of(doc)`` reads them back."""

    def doc(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def of(cls, doc: str | bytes) -> Self:
        return cls(**json.loads(doc))
