"""NumPy's OpenBLAS on one thread, from inside a running process: what a review that times a
server on this machine's CPU needs (on two cores a second BLAS thread waits for the core the
server's loop and its clients need; `python -m tools.bench blas-threads` measures it). The command
line sets OPENBLAS_NUM_THREADS before NumPy loads (cli.py); a caller from Python has NumPy loaded
already, so `one_blas_thread()` sets the count through OpenBLAS's own entry points, found among
the libraries the process has loaded (as threadpoolctl finds them).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Callable, Iterator

# (prefix, suffix) of OpenBLAS's symbols: NumPy's wheels (scipy-openblas, 64-bit ints), an ILP64
# build, a system OpenBLAS
_SYMBOLS = (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", ""))


def openblas_threads() -> tuple[Callable[[], int], Callable[[int], None]] | None:
    """(get, set) of the thread count of the OpenBLAS this process has loaded; None where there is
    none to be found (another BLAS, such as Accelerate or MKL, or no /proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line})
    except OSError:
        return None
    for path in paths:
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in _SYMBOLS:
            get = getattr(library, f"{prefix}_get_num_threads{suffix}", None)
            put = getattr(library, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and put is not None:
                get.restype = ctypes.c_int
                put.argtypes = [ctypes.c_int]
                return get, put
    return None


@contextlib.contextmanager
def one_blas_thread() -> Iterator[int | None]:
    """OpenBLAS on one thread inside the block, its count before put back after; yields that count
    (None: no OpenBLAS in this process, so nothing to pin: OPENBLAS_NUM_THREADS would not pin it either)."""
    found = openblas_threads()
    if found is None:
        yield None
        return
    get, put = found
    before = get()
    put(1)
    try:
        yield before
    finally:
        put(before)
