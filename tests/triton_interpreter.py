"""Whether Triton's CPU interpreter can run routekit's kernels in this environment.

Triton 3.6's interpreter (the one torch 2.11 ships with) hands a kernel's integer arguments to `range` as
one-element arrays and converts them with `int()`, which NumPy 2.4 refuses ("only 0-dimensional arrays can be
converted to Python scalars"); every kernel that loops over a runtime count then fails on the CPU, though the
same kernels compile and run on a GPU. Later Triton releases convert them properly. The tests that run the
kernels in the interpreter skip with this reason rather than fail on a third-party incompatibility.
"""

from __future__ import annotations

import functools


@functools.cache
def problem() -> str | None:
    """None when the interpreter runs a loop over a runtime count, else why not and what fixes it."""
    import numpy
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def count(out_ptr, n):
        for i in range(0, n):
            tl.store(out_ptr + i, i)

    out = torch.zeros(2, dtype=torch.int32)
    try:
        count[(1,)](out, 2)
    except Exception as err:  # the interpreter wraps the TypeError in its own error type
        if "0-dimensional" not in str(err):
            raise
        return (f"Triton {triton.__version__}'s CPU interpreter cannot loop over a runtime count with NumPy "
                f"{numpy.__version__} (int() of a one-element array); `pip install 'numpy<2.4'` or a newer Triton "
                "runs these tests")
    return None
