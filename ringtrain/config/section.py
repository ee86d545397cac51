"""The base of every config section: unknown keys refused, no silent conversion, a docstring per field."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["Section"]


class Section(BaseModel):
    # strict: a string where a number belongs is an error, not a silent conversion.
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, frozen=True)
