"""Pointer tables: how every Triton kernel here reads a list of tensors in place, without a stack.

A kernel gets an int64 tensor of the sources' data pointers (``pointer_table``) and loads each source through
it. The aggregation, the merges and the weighted sums all read their sources this way, so the tables and
their cache live here, below every kernel module, and each imports them from here. No triton import: the
tables are plain torch tensors.
"""

from __future__ import annotations

import concurrent.futures

import torch
from torch import Tensor

# Pointer tables by (device, pointers): in a training loop the caching allocator hands the same
# addresses back every step, and a backward reads the same sources as its forward, so building a
# table (a host tensor, pinned, copied to the device) becomes a dictionary lookup. A table's content
# depends only on its key, so a hit is always right, whatever tensor now lives at those addresses.
_TABLES: dict[tuple, tuple[Tensor, bool]] = {}
TABLE_CACHE_SIZE = 1024
# What CUDA graphs read, kept for the life of the process: the cached tables a captured kernel reads,
# and the pinned host copy of a table built during a capture (the graph replays that copy into a
# temporary of its own pool). Freed, either could be handed out again and a replay would read its
# pointers from someone else's data. A few hundred bytes per table a captured step uses.
_GRAPH_TABLES: list[Tensor] = []
_HELPER: concurrent.futures.ThreadPoolExecutor | None = None


def _cached_table_storage(n: int, device: torch.device) -> Tensor:
    """An int64 device tensor for a cached table, allocated on a helper thread: while a thread warms up
    or captures a CUDA graph (torch.compile's reduce-overhead mode, torch.cuda.graph) its allocations
    go to that graph's memory pool, which must hold nothing that outlives the graph's own outputs;
    a cached table does."""
    global _HELPER
    if _HELPER is None:
        _HELPER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="routekit-tables")
    table = _HELPER.submit(torch.empty, (n,), dtype=torch.int64, device=device).result()
    stream = torch.cuda.current_stream(device)
    if stream != torch.cuda.default_stream(device):  # allocated for the default stream's order
        stream.wait_stream(torch.cuda.default_stream(device))
        table.record_stream(stream)
    return table


def table_of(ptrs: list[int], device: torch.device) -> tuple[Tensor, bool]:
    """Int64 tensor of ``ptrs`` on ``device``, and whether all are 16-byte aligned."""
    key = (device, *ptrs)
    hit = _TABLES.get(key)
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if hit is not None:
        if capturing:  # the graph will read this table: it must outlive an eviction
            _GRAPH_TABLES.append(hit[0])
        return hit
    aligned = all(p % 16 == 0 for p in ptrs)
    table = torch.tensor(ptrs, dtype=torch.int64)
    if device.type == "cuda":
        host = table.pin_memory()
        if capturing:  # a temporary of the graph, not cached: its copy runs when the graph does
            _GRAPH_TABLES.append(host)
            return host.to(device, non_blocking=True), aligned
        table = _cached_table_storage(len(ptrs), device).copy_(host, non_blocking=True)
    if len(_TABLES) >= TABLE_CACHE_SIZE:
        del _TABLES[next(iter(_TABLES))]  # the oldest
    _TABLES[key] = table, aligned
    return _TABLES[key]


def pointer_table(tensors: list[Tensor]) -> tuple[Tensor, bool]:
    """The data pointers of ``tensors`` as an int64 tensor on their device, and whether all are
    16-byte aligned."""
    return table_of([t.data_ptr() for t in tensors], tensors[0].device)


def contiguous(tensors: list[Tensor]) -> list[Tensor]:
    """``tensors``, each made contiguous where it is not: a table holds one pointer per source, so the kernels
    read every source with the same strides."""
    return [t if t.is_contiguous() else t.contiguous() for t in tensors]
