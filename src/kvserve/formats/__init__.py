"""One reader per checkpoint metadata format, shared by the model loader and the planner.

``hf_config`` reads a Hugging Face config.json, ``gguf_metadata`` the key/value metadata of a
GGUF file.  Both are pure Python and import nothing from the serving packages, so the planner
can use them without torch, and both readers of a format apply the same defaults and rules.
A leaf unit: it imports only kvserve.errors.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

from kvserve.errors import UserInputError

T = TypeVar("T")


class FormatError(UserInputError):
    """A metadata field is missing or malformed; the message names the field and the file.

    The loader re-raises it as ModelLoadError and the planner as PlanError, so each caller's
    error type stays its own; all three are input the user can fix (CLI exit 2)."""


def build(target: type[T], metadata: Any, **own: Any) -> T:
    """`target` (a dataclass) from the fields `metadata` has under the same names, plus `own`.

    The readers name their fields as ModelConfig and ModelShape do, so each caller copies the
    common ones in one place and spells out only what it decides itself (`own` wins)."""
    names = {f.name for f in dataclasses.fields(target)}
    common = {name: getattr(metadata, name) for name in names if hasattr(metadata, name)}
    return target(**{**common, **own})
