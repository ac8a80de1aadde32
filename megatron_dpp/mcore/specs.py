"""Replacing the layer classes a Megatron-Core spec names: the public way to choose them."""
from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Optional


def replace_spec_classes(value, classes: Mapping[type, type],
                         refuse: Optional[Callable[[type], None]] = None):
    """A copy of `value` (a ModuleSpec, a *Submodules dataclass, or a list or tuple of them) with
    every class that is a key of `classes` replaced by its value; `refuse(cls)` is called on every
    class met and may raise. The given spec (often a module global of Megatron-Core) is left as
    it is."""
    if isinstance(value, type):
        if refuse is not None:
            refuse(value)
        return classes.get(value, value)
    if isinstance(value, (list, tuple)):
        return type(value)(replace_spec_classes(item, classes, refuse) for item in value)
    if dataclasses.is_dataclass(value):  # ModuleSpec and the *Submodules dataclasses
        return dataclasses.replace(value, **{
            field.name: replace_spec_classes(getattr(value, field.name), classes, refuse)
            for field in dataclasses.fields(value) if field.init})
    return value  # functions (bias-dropout-add), dicts of names, None
