# --- DAR kernel tests (tests/test_dar_kernel.py): keep these lines first. ---
# Without CUDA, Triton kernels must run in Triton's CPU interpreter, and `triton.jit` picks
# interpreter or compiler when a kernel module is imported; so set it before any test module
# (collected in one process with xdist --dist loadfile) can import routekit.kernels.aggregation.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end DAR kernel ---

# --- routekit property tests (tests/test_routes.py, test_errors.py, test_compile.py) ---
# Tiny models on a busy 2-core CI box run ~40x faster on one intra-op thread (no OpenMP oversubscription
# under xdist); modules opt in with `pytestmark = pytest.mark.usefixtures("one_thread")`.
import pytest  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
# --- end routekit property tests ---

# --- Hypothesis: the same examples on every run (CI must not turn red by chance) ---
# HYPOTHESIS_PROFILE=explore searches afresh each run, to hunt for new counterexamples locally.
from hypothesis import settings  # noqa: E402

settings.register_profile("routekit", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "routekit"))
# --- end Hypothesis ---
