"""How many threads a process computes on, decided in one place, with nested parallelism off.

torch (OpenMP through libgomp, MKL's sgemm on the same libgomp), numba (its own pool, or
OpenMP) and numpy's OpenBLAS each keep a thread pool, and on a small box they fight:

- numba's OpenMP threading layer calls ``omp_set_nested(1)`` on the libgomp torch loaded
  (one libgomp per process). From then on every torch op that runs MKL inside its own parallel
  region (SDPA: at::parallel_for -> sgemm) opens a second level of threads: 4 threads on 2
  cores, spinning at each other's barriers. The test suite ran 27 minutes instead of 20 s in
  one test that way (benchmarks/README.md, "Threads").
- vLLM's CPU worker replaces ``torch.set_num_threads`` with a no-op in its process, so every
  later "one thread here" silently did nothing.

:func:`configure` is that one place: the driver calls it (``runtime.execute``), every stage
worker (in a Ray actor and in process), and the test session (``tests/conftest.py``). It sets
torch's intra-op threads with the real setter, one inter-op thread where torch still allows
it, libgomp's max active levels to 1, numba's thread count and threading layer
(``workqueue``: numba's own pool, so it never touches the libgomp torch uses), BLAS pools via
threadpoolctl, and the environment variables that libraries read when they are first imported
and that child processes (Ray workers) inherit.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: numba's own thread pool: no OpenMP, so it can neither turn nesting on nor change the
#: thread count of the libgomp that torch shares with it.
NUMBA_LAYER = "workqueue"

#: Variables read when a library is first loaded (libgomp, MKL, OpenBLAS, numba), so they
#: only take effect in this process for libraries not yet imported, and in child processes.
_COUNT_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def cpu_count() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure(threads: int) -> int:
    """Make this process compute on ``threads`` threads (at least 1) in every library, with
    nested parallelism off. Safe to call again (the last call wins); returns the count."""
    n = max(1, int(threads))
    set_environment(n)
    set_torch_threads(n)
    openmp_nesting_off()
    _numba(n)
    _blas(n)
    return n


def set_environment(threads: int) -> None:
    """The variables libraries read at import (for this process's later imports and for the
    processes it starts)."""
    for var in _COUNT_VARS:
        os.environ[var] = str(threads)
    os.environ["OMP_MAX_ACTIVE_LEVELS"] = "1"
    os.environ.setdefault("NUMBA_THREADING_LAYER", NUMBA_LAYER)


def set_torch_threads(threads: int) -> None:
    """torch's intra-op threads, through torch's own setter even where vLLM's CPU worker has
    replaced ``torch.set_num_threads`` with a no-op (its in-process engine binds no threads,
    so nothing of vLLM's depends on the count staying put). One inter-op thread: dapo-flow
    never forks torch work, and torch allows setting it only before its first use."""
    if "torch" not in sys.modules and not _importable("torch"):
        return
    import torch

    if torch._C.get_num_threads() != threads:
        torch._C.set_num_threads(threads)
    try:
        if torch.get_num_interop_threads() != 1:
            torch.set_num_interop_threads(1)
    except RuntimeError:  # inter-op pool already started: leave it (it idles, it does not spin)
        pass


def openmp_nesting_off() -> bool:
    """Set libgomp's max active levels to 1 in this process (an inner parallel region then
    runs on the thread that opened it). Returns whether a loaded libgomp was found."""
    gomp = _loaded_libgomp()
    if gomp is None:
        return False
    gomp.omp_set_nested(0)  # deprecated but what numba's OpenMP layer turns on; older libgomp
    gomp.omp_set_max_active_levels(1)  # reads the two separately
    return True


def openmp_nested() -> bool | None:
    """Whether nested OpenMP parallelism is on in this process (None: no libgomp loaded)."""
    gomp = _loaded_libgomp()
    if gomp is None:
        return None
    return bool(gomp.omp_get_nested()) and gomp.omp_get_max_active_levels() > 1


def _loaded_libgomp() -> ctypes.CDLL | None:
    # RTLD_NOLOAD: only the libgomp already in the process (torch's, found by its soname);
    # loading a second copy would configure a runtime nobody uses
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_GLOBAL)
    except (OSError, AttributeError):
        return None


def prefer_numba_layer() -> None:
    """Before numba's first parallel launch: its :data:`NUMBA_LAYER` (unless the user chose one),
    also in processes that never called :func:`configure` (a library user, a benchmark)."""
    numba = sys.modules.get("numba")
    if numba is None:
        os.environ.setdefault("NUMBA_THREADING_LAYER", NUMBA_LAYER)
        return
    from numba.np.ufunc import parallel

    if not parallel._is_initialized:
        numba.config.THREADING_LAYER = os.environ.get("NUMBA_THREADING_LAYER", NUMBA_LAYER)


def numba_on_openmp() -> bool:
    """Whether numba has launched its OpenMP layer in this process."""
    numba = sys.modules.get("numba")
    if numba is None:
        return False
    from numba.np.ufunc import parallel

    return bool(parallel._is_initialized) and numba.threading_layer() == "omp"


def _numba(threads: int) -> None:
    """numba's thread count, and its threading layer while numba has not launched threads yet
    (the layer is fixed at the first parallel launch). Not imported here: it costs ~0.4 s."""
    prefer_numba_layer()
    numba = sys.modules.get("numba")
    if numba is None:
        return
    numba.set_num_threads(max(1, min(threads, numba.config.NUMBA_NUM_THREADS)))


def _blas(threads: int) -> None:
    """numpy's OpenBLAS (and any other BLAS loaded) to ``threads``; torch's MKL is linked into
    torch and follows torch's OpenMP count. threadpoolctl is a dependency: without it numpy's
    pool would keep one thread per core beside torch's, so a broken install is an error."""
    try:
        from threadpoolctl import threadpool_limits
    except ImportError as exc:
        from dapo_flow.errors import broken_dependency

        raise broken_dependency("threadpoolctl", exc) from exc
    threadpool_limits(limits=threads, user_api="blas")


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
