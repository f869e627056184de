"""``host_register``/``host_unregister`` as vLLM 0.32.0's: cudaHostRegister through the libcudart
the process has loaded (as vLLM's ``CudaRTLibrary`` finds it), clearing CUDA's last error after a
failure, without vLLM's platform layer."""

import ctypes
import logging

logger = logging.getLogger(__name__)
_lib: ctypes.CDLL | None = None


def _cudart() -> ctypes.CDLL:
    global _lib
    if _lib is None:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "libcudart" in line]
        if not paths:
            raise OSError("no libcudart loaded in this process")
        _lib = ctypes.CDLL(paths[0])
        _lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        _lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    return _lib


def host_register(ptr: int, num_bytes: int) -> bool:
    if not ptr or num_bytes <= 0:
        return False
    try:
        lib = _cudart()
    except OSError:
        logger.warning("no CUDA runtime loaded: the region stays pageable")
        return False
    result = lib.cudaHostRegister(ptr, num_bytes, 0)
    if result != 0:
        lib.cudaGetLastError()
        logger.warning("cudaHostRegister failed (code=%d): the region stays pageable", result)
        return False
    return True


def host_unregister(ptr: int) -> None:
    if ptr:
        _cudart().cudaHostUnregister(ptr)
