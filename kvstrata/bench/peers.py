"""The peers ``kvstrata bench serve`` runs beside kvstrata: vLLM's own offloading and LMCache.

vLLM's offloading (``OffloadingConnector``): its stock CPU worker refuses non-CUDA/XPU devices,
so on a CPU engine both its CPU tier and its tiered spec with the fs tier run through the small
out-of-tree spec in the repository's ``benchmarks/vllm_fs_baseline.py`` (benchmarks/README.md).
The server names it by module (``spec_module_path``); nothing here imports it, and without a
repository checkout beside the package those configurations are skipped with that reason.

LMCache (lmcache 0.5.6, multiprocess mode: a ``lmcache server`` plus ``LMCacheMPConnector``) is
never a kvstrata dependency: it lives in a virtual environment of its own that sees this
environment's packages (a ``.pth`` file) and adds ``lmcache``, ``aiofile`` and ``caio`` with
``--no-deps``. vLLM 0.32's CPU build then fails at start-up in
``vllm/triton_utils/dispatcher.py`` ``_rebind_kernels`` once numba/llvmlite is imported (a
``vars()`` of llvmlite's ``ffi.lib`` returns a fake object): the environment's shim gives that one
module a ``vars`` that returns ``{}`` for non-dict results. The settings (``--supported-transfer-mode
auto``, ``--shm-name``) are those measured in the project's notes on running the peers on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import kvstrata

LMCACHE_VERSION = "0.5.6"
LMCACHE_VENV_ENV = "KVSTRATA_LMCACHE_VENV"
SHIM_MODULE = "kvstrata_lmcache_shim"
VLLM_SPEC_NAME = "CPUCopyTieringSpec"
VLLM_SPEC_MODULE = "benchmarks.vllm_fs_baseline"

# Installed as <venv site-packages>/kvstrata_lmcache_shim.py and imported by a .pth at start-up
# of every process of that environment (the API server and vLLM's engine core alike).
SHIM_SOURCE = '''"""vLLM 0.32 CPU + llvmlite: give vllm.triton_utils.dispatcher a safe vars()."""
import builtins
import importlib.abc
import sys

_TARGET = "vllm.triton_utils.dispatcher"


def _safe_vars(*args):
    out = builtins.vars(*args)
    return out if isinstance(out, dict) else {}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        inner = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return inner.create_module(spec)

            def exec_module(self, module):
                module.__dict__["vars"] = _safe_vars
                inner.exec_module(module)

        spec.loader = _Loader()
        return spec


sys.meta_path.insert(0, _Finder())
'''


class PeerUnavailable(RuntimeError):
    """A peer cannot run here; the message says why (it goes into the JSON as the skip reason)."""


def repo_root() -> Path | None:
    """The repository checkout the package runs from, if ``benchmarks/`` is beside it."""
    root = Path(kvstrata.__file__).resolve().parents[1]
    return root if (root / "benchmarks" / "vllm_fs_baseline.py").is_file() else None


def vllm_offload_config(host_bytes: int, fs_dir: Path | None) -> tuple[dict[str, Any], dict[str, str]]:
    """(kv_transfer_config, extra environment) for vLLM's CPU tier, plus the fs tier when
    ``fs_dir`` is given. Raises :class:`PeerUnavailable` without the repository's spec."""
    root = repo_root()
    if root is None:
        raise PeerUnavailable("vLLM's offloading needs benchmarks/vllm_fs_baseline.py from a "
                              "kvstrata repository checkout (its CPU worker); none beside the package")
    extra: dict[str, Any] = {"spec_name": VLLM_SPEC_NAME, "spec_module_path": VLLM_SPEC_MODULE,
                             "cpu_bytes_to_use": int(host_bytes)}
    if fs_dir is not None:
        extra["secondary_tiers"] = [{"type": "fs", "root_dir": str(fs_dir)}]
    cfg = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    path = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return cfg, {"PYTHONPATH": path}


def default_lmcache_venv() -> Path:
    env = os.environ.get(LMCACHE_VENV_ENV)
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvstrata" / "lmcache-venv"


def _venv_site(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def ensure_lmcache_venv(venv: Path, say: Any = None) -> Path:
    """Create (once) and return the LMCache environment's python. Raises :class:`PeerUnavailable`
    with pip's last words when it cannot be installed."""
    python = venv / "bin" / "python"
    site = _venv_site(venv)
    shared = sysconfig.get_paths()["purelib"]
    try:
        if not python.exists():
            if say:
                say(f"lmcache: creating {venv}")
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                           capture_output=True, timeout=300)
        site.mkdir(parents=True, exist_ok=True)
        # This environment's packages (vLLM, torch) are the same for LMCache: no second copy.
        (site / "zz_kvstrata_shared.pth").write_text(shared + "\n")
        (site / f"{SHIM_MODULE}.py").write_text(SHIM_SOURCE)
        (site / "zz_kvstrata_lmcache_shim.pth").write_text(f"import {SHIM_MODULE}\n")
        check = subprocess.run([str(python), "-c", "import lmcache, aiofile"], capture_output=True,
                               text=True, timeout=300)
        if check.returncode != 0:
            if say:
                say(f"lmcache: pip install --no-deps lmcache=={LMCACHE_VERSION} aiofile caio")
            pip = subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site),
                 f"lmcache=={LMCACHE_VERSION}", "aiofile", "caio"],
                capture_output=True, text=True, timeout=900)
            if pip.returncode != 0:
                raise PeerUnavailable(f"pip could not install lmcache=={LMCACHE_VERSION}: "
                                      + (pip.stderr or pip.stdout).strip()[-300:])
            check = subprocess.run([str(python), "-c", "import lmcache, aiofile"],
                                   capture_output=True, text=True, timeout=300)
            if check.returncode != 0:
                raise PeerUnavailable("lmcache installed but does not import: "
                                      + check.stderr.strip()[-300:])
    except (OSError, subprocess.SubprocessError) as exc:
        raise PeerUnavailable(f"cannot create the LMCache environment {venv}: {exc}") from None
    return python


class LMCacheServer:
    """``lmcache server`` with an L1 DRAM tier of ``l1_gb`` and an ``fs_native`` disk tier."""

    def __init__(self, python: Path, disk_dir: Path, l1_gb: float, log: Path, port: int,
                 http_port: int, chunk_size: int = 256) -> None:
        disk_dir.mkdir(parents=True, exist_ok=True)
        self.port = port
        self.log = log
        # The console script is a thin wrapper; run its module with the environment's python.
        cmd = [str(python), "-c", "import sys; from lmcache.cli.main import main; "
               "sys.argv[0] = 'lmcache'; sys.exit(main())",
               "server", "--host", "localhost", "--port", str(port), "--chunk-size",
               # --l1-size-gb is a float (GiB); lazy growth off so the whole L1 is there from
               # the start, as kvstrata's host tier is (--l1-init-size-gb is then unused).
               str(chunk_size), "--l1-size-gb", f"{l1_gb:.6g}", "--no-l1-use-lazy",
               "--eviction-policy", "LRU", "--max-workers", "1",
               "--supported-transfer-mode", "auto", "--shm-name", f"kvstrata_bench_{port}",
               "--l2-adapter", json.dumps({"type": "fs_native", "base_path": str(disk_dir),
                                           "num_workers": 1}),
               "--disable-observability", "--http-port", str(http_port)]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        time.sleep(2.0)
        if self.proc.poll() is not None:
            raise PeerUnavailable(f"lmcache server exited with {self.proc.returncode}: "
                                  + log.read_text(errors="replace")[-400:])

    def transfer_config(self) -> dict[str, Any]:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost",
                                              "lmcache.mp.port": self.port}}

    def stop(self) -> bool:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
                return False
        return True
