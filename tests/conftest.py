# --- DAR kernel tests (tests/test_dar_kernel.py): keep these lines first. ---
# Without CUDA, Triton kernels must run in Triton's CPU interpreter, and `triton.jit` picks
# interpreter or compiler when a kernel module is imported; so set it before any test module
# (collected in one process with xdist --dist loadfile) can import routekit.kernels.aggregation.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end DAR kernel ---

# --- one intra-op thread per test process ---
# The suite runs as two xdist workers on a 2-core CI box; torch's default of one OpenMP thread per core then
# puts four spinning threads on two cores, and tiny models run ~20-40x slower. The tests' models are all tiny,
# so every test process runs on one thread, and OMP_NUM_THREADS=1 reaches the benchmark and launcher
# subprocesses the tests start.
os.environ["OMP_NUM_THREADS"] = "1"
torch.set_num_threads(1)
# --- end one thread ---

# --- Hypothesis: the same examples on every run (CI must not turn red by chance) ---
# HYPOTHESIS_PROFILE=explore searches afresh each run, to hunt for new counterexamples locally.
from hypothesis import settings  # noqa: E402

settings.register_profile("routekit", derandomize=True)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "routekit"))
# --- end Hypothesis ---
