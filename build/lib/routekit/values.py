"""What routekit keeps of the values a model computes: shapes and dtypes, and the structure around them.

Tracing and recording run the model on example inputs; the analysis needs only each tensor's shape and
dtype (`TensorMeta`, put in place of the tensor by `describe`), and checks of outputs need their leaves in
order, inside dataclasses too (`flatten`). The frozen records that hold what was found (a trace, the
report) hold read-only mappings (`read_only`), pickled as plain dicts (`pickled_fields`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.utils._pytree as pytree


@dataclass(frozen=True)
class TensorMeta:
    """Shape and dtype of a traced tensor; the analysis needs nothing more."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return f"{str(self.dtype).removeprefix('torch.')}[{', '.join(map(str, self.shape))}]"


def describe(value: Any) -> Any:
    """Replace tensors by TensorMeta inside any structure, to keep metadata without the memory.

    A dataclass pytree does not know (fx builds such outputs in the graph) becomes the tuple of its fields.
    """

    def leaf(v):
        if isinstance(v, torch.Tensor):
            return TensorMeta(tuple(v.shape), v.dtype)
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return tuple(describe(getattr(v, f.name)) for f in dataclasses.fields(v))
        return v

    return pytree.tree_map(leaf, value)


def flatten(value: Any) -> tuple[list, list]:
    """Leaves and structure of a value, descending into dataclasses that pytree does not know."""
    leaves, spec = pytree.tree_flatten(value)
    flat, structure = [], [spec]
    for v in leaves:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            inner, inner_structure = flatten({f.name: getattr(v, f.name) for f in dataclasses.fields(v)})
            flat.extend(inner)
            structure.append((type(v), inner_structure))
        else:
            flat.append(v)
    return flat, structure


def read_only(mapping: Mapping) -> MappingProxyType:
    """A read-only view of a copy of `mapping`: what a frozen record holds in place of a dict, so nobody writes
    into it after it is made."""
    return MappingProxyType(dict(mapping))


def pickled_fields(record: Any) -> tuple:
    """A frozen record's fields, in order, with its read-only mappings as plain dicts: a mappingproxy does not
    pickle (nor deep-copy), so a record's `__reduce__` hands these to its constructor, which makes them
    read-only again."""
    return tuple(dict(v) if isinstance(v, MappingProxyType) else v
                 for v in (getattr(record, f.name) for f in dataclasses.fields(record)))


def same(a: Any, b: Any) -> bool:
    """`a == b` for recorded values (TensorMeta, plain values, containers of them); False where they do not
    compare (a tensor's `==` is elementwise, an object's may raise): then they are not known to be the same."""
    try:
        return bool(a == b)
    except Exception:
        return False
