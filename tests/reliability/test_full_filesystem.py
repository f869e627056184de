"""Fill a tiny file system: put records until it is full, delete some, put again, unmount.

Needs root and a working ``mount -t tmpfs`` (skipped otherwise). The filling runs in a child
process (a SIGBUS on a full file system must fail this test, not end the run). Required:
``put_many`` never raises and counts what it drops, every admitted record reads back as
written, the space deletes free is used again, and the store copied off the file system after
unmounting serves exactly the records it should and is sound.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import torture as t

from kvstrata.tiers.disk import DiskStore

SIZE = "12m"


@pytest.fixture
def tiny_fs(tmpfs: Callable[[str], Path]) -> Path:
    return tmpfs(SIZE)


def test_full_file_system_drops_puts_and_keeps_serving(tiny_fs: Path, tmp_path: Path) -> None:
    store = tiny_fs / "store"
    run = t.run_child("fill", str(store), timeout=120)
    tal = t.tally("full file system")
    tal.trials += 1
    tal.crashed += int(run.returncode != 0)
    assert run.returncode == 0, f"the filling child failed ({run.returncode}): {t.last_lines(run.stderr, 12)}"
    r = json.loads(run.stdout.strip().splitlines()[-1])
    tal.wrong += len(r["wrong"])
    tal.served += r["admitted"]
    tal.detected += r["dropped"]
    assert not r["raised"], f"put_many raised: {r['raised'][:3]}"
    assert not r["wrong"], f"{len(r['wrong'])} admitted records read back WRONG"
    assert r["admitted"] > 0 and r["dropped"] > 0, r
    assert r["full_events"] >= 1 and r["admission_drops"] >= r["dropped"], r
    assert r["readmitted"] > 0, f"nothing admitted into the pages the deletes freed: {r}"

    copy = tmp_path / "copy"
    shutil.copytree(store, copy)
    subprocess.run(["umount", str(tiny_fs)], check=True)
    present = [bytes.fromhex(k) for k in r["present"]]
    deleted = [bytes.fromhex(k) for k in r["deleted"]]
    with DiskStore(copy, budget_bytes=1 << 40, create=False) as reopened:
        assert reopened.wait_recovery(60)
        for key in present + deleted:
            out = bytearray(t.value_len(key))
            n = reopened.get_into(key, out)
            tal.wrong += int(n is not None and bytes(out[:n]) != t.expected(key))
            what = "kept" if key in present else "deleted"
            assert (n is not None) == (key in present), f"{what} record {t.describe_key(key)}: read {n}"
            assert n is None or bytes(out[:n]) == t.expected(key), f"WRONG bytes for {t.describe_key(key)}"
    verify = t.cli("verify", "--json", str(copy))
    assert verify.rc == 0 and verify.report.get("status") == "sound", verify.describe()
