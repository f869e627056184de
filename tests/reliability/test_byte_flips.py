"""Flip bytes of a store with a known content, then read everything back in subprocesses.

Each trial damages a copy of a template store: (a) bytes of payload frames, (b) LMDB's own
structure (meta, branch and leaf pages, overflow page numbers and headers, or any byte of the
file), (c) one record of the ``meta`` or ``index`` database, and the redirect of the issue (a leaf's
overflow page number pointing at another key's frame). Then:

* a probe child opens the store, reads every key, calls ``contains_many``, ``stats``,
  ``iter_index``, ``put_many`` (with evictions) and ``close`` (opening may fail with a clear
  ``StoreFormatError``/``StoreUnavailableError``);
* meanwhile, on a copy of the damaged store, ``kvstrata verify``, ``inspect`` (and ``export``
  for the meta/index records), ``verify --repair`` and ``verify`` run as subprocesses;
* then ``verify --repair`` and ``verify`` run on the store the probe used (a server kept
  writing into the damaged store before the operator repaired it);
* a probe reads both repaired stores and puts new records into them.

Required: no read ever returns bytes other than those written for its key; nothing crashes
(traceback, unexpected exit status, signal, hang); the records a damage did not touch are still
served and, where the damage is in a record rather than in LMDB's structure, the store still
admits new records (evicting for them); after ``verify --repair``, ``verify`` says sound, and a
store called sound serves what it served, keeps it through new puts and serves those. A store
the tools cannot open at all must be refused with one clear line by every tool (and a store a
server opened must not be refused).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb_pages as lp
import numpy as np
import pytest
import torture as t

from kvstrata.tiers.disk import DiskStore

NS = [b"model-a-rank-0!!", b"model-b-rank-0!!"]
FRESH = 8  # records the probe puts into the damaged store (its budget makes them evict)


@dataclass(frozen=True)
class Template:
    path: Path
    keys: list[bytes]
    stored_bytes: int


@dataclass
class Damage:
    what: str
    suspects: list[bytes] = field(default_factory=list)  # keys the damage may have made up
    min_served: int = 0  # reads of the first pass that must still be served correctly
    max_served: int | None = None  # and at most: the damaged records must be detected
    require_puts: bool = False  # the damaged store must still admit (and evict for) new records


Damager = Callable[[Path, lp.Layout, np.random.Generator, Template], Damage]


def build(path: Path, keys: list[bytes], codec: str) -> Template:
    with DiskStore(path, budget_bytes=1 << 30, codec=codec) as store:
        for i, ns in enumerate(NS):
            store.register_namespace(ns, {"model": f"/models/{i}", "dtype": "bfloat16", "tp_rank": 0})
        for key in keys:  # one transaction each: the same page layout every run
            assert store.put_many([(key, t.expected(key), "bfloat16")]) == 1
        stored = int(store.stats()["stored_bytes"])
    return Template(path, keys, stored)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """160 records in two namespaces and two groups; every 8th is small (inline in its leaf),
    the others span overflow pages; the payload and index trees have branch pages."""
    keys = [
        t.make_key(ns, i, 256 if i % 8 == 0 else 8192, group)
        for ns in NS for group in (0, 1) for i in range(40)
    ]
    return build(tmp_path_factory.mktemp("template") / "store", keys, "auto")


@pytest.fixture(scope="module")
def raw_template(tmp_path_factory: pytest.TempPathFactory) -> Template:
    """64 records of one size stored raw: every frame is exactly as long as every other."""
    keys = [t.make_key(NS[0], i, 8192) for i in range(64)]
    return build(tmp_path_factory.mktemp("raw-template") / "store", keys, "raw")


# ---- damages -----------------------------------------------------------------------------------


def describe(layout: lp.Layout, offset: int) -> str:
    pgno = offset // layout.psize
    if pgno < 2:
        role = "meta page" + (" (current)" if pgno == layout.meta else " (previous)")
    elif pgno in layout.branches:
        role = f"branch page of {layout.branches[pgno]}"
    elif pgno in layout.leaves:
        role = f"leaf page of {layout.leaves[pgno]}"
    else:
        runs = [p for p, n in layout.overflows.items() if p <= pgno < p + n]
        role = "overflow page" if runs else "free page"
    return f"byte {offset} (page {pgno}, {role}, +{offset % layout.psize})"


def flip_at(path: Path, layout: lp.Layout, offset: int, mask: int) -> list[bytes]:
    """Flip one byte; returns the keys it turns leaf keys of payload/index into."""
    made_up = []
    for node, i in layout.keys_at(offset):
        if node.db in ("payload", "index"):
            key = bytearray(node.key)
            key[i] ^= mask
            made_up.append(bytes(key))
    lp.flip(path, offset, mask)
    return made_up


def payload_frames(path: Path, layout: lp.Layout, rng: np.random.Generator, tpl: Template) -> Damage:
    nodes = layout.db_nodes("payload")
    victims = [nodes[int(i)] for i in rng.choice(len(nodes), int(rng.integers(1, 3)), replace=False)]
    done = []
    for node in victims:
        start, end = layout.value_range(node)
        for offset in rng.choice(np.arange(start, end), int(rng.integers(1, 4)), replace=False):
            mask = int(rng.integers(1, 256))
            lp.flip(path, int(offset), mask)
            done.append(f"{describe(layout, int(offset))} ^ {mask:#04x}")
    return Damage(
        f"payload frames of {len(victims)} record(s): {'; '.join(done)}",
        min_served=len(tpl.keys) - len(victims), max_served=len(tpl.keys) - len(victims),
        require_puts=True,
    )


def structure(kind: str) -> Damager:
    def damage(path: Path, layout: lp.Layout, rng: np.random.Generator, tpl: Template) -> Damage:
        mask = int(rng.integers(1, 256))
        if kind == "meta":
            offset = layout.meta * layout.psize + int(rng.integers(lp.PAGE_HEADER, lp.META_END))
        elif kind in ("branch", "leaf"):
            pages = sorted(layout.branches if kind == "branch" else layout.leaves)
            ranges = layout.used_bytes(pages[int(rng.integers(len(pages)))])
            offset = int(rng.choice(np.concatenate([np.arange(a, b) for a, b in ranges])))
        elif kind in ("payload key", "index key"):
            # A high byte of the serial (zero in every key) of the middle key of a leaf: it
            # jumps out of order where every lookup in the leaf looks first (LMDB's binary
            # search), so its neighbours on one side cannot be found either.
            leaves = sorted(p for p, db in layout.leaves.items() if db == kind.split()[0])
            page = leaves[int(rng.integers(len(leaves)))]
            nodes = [n for n in layout.nodes if n.page == page]
            node = nodes[(len(nodes) - 1) // 2]
            offset = node.key_at + int(rng.integers(t.NS_BYTES + 4, t.KEY_BYTES - 8))
        elif kind == "overflow number":  # a nearby page: inside the file, often another frame
            nodes = [n for n in layout.nodes if n.overflow is not None]
            offset = nodes[int(rng.integers(len(nodes)))].value_at + int(rng.integers(0, 2))
            mask = 1 << int(rng.integers(0, 8))
        elif kind == "overflow header":
            runs = sorted(layout.overflows)
            offset = runs[int(rng.integers(len(runs)))] * layout.psize + int(rng.integers(0, lp.PAGE_HEADER))
        else:
            offset = int(rng.integers(0, layout.file_size))
        what = f"{kind}: {describe(layout, offset)} ^ {mask:#04x}"
        return Damage(what, suspects=flip_at(path, layout, offset, mask))

    return damage


def undecodable_first_byte(path: Path, layout: lp.Layout, node: lp.Leaf, rng: np.random.Generator) -> str:
    """Flip the first byte of a msgpack array or JSON object value so that it no longer decodes
    (a fixarray or '{' with the top bit flipped is a small integer or an invalid byte)."""
    mask = 0x80 | int(rng.integers(0, 128))
    lp.flip(path, node.value_at, mask)
    return f"{describe(layout, node.value_at)} ^ {mask:#04x}"


def totals(path: Path, layout: lp.Layout, rng: np.random.Generator, tpl: Template) -> Damage:
    where = undecodable_first_byte(path, layout, layout.node("meta", b"totals"), rng)
    return Damage(f"meta 'totals' record undecodable: {where}", min_served=len(tpl.keys), require_puts=True)


def index_record(path: Path, layout: lp.Layout, rng: np.random.Generator, tpl: Template) -> Damage:
    nodes = layout.db_nodes("index")
    node = nodes[int(rng.integers(len(nodes)))]
    where = undecodable_first_byte(path, layout, node, rng)
    return Damage(
        f"index record of {t.describe_key(node.key)} undecodable: {where}",
        min_served=len(tpl.keys) - 1, require_puts=True,
    )


def namespace(path: Path, layout: lp.Layout, rng: np.random.Generator, tpl: Template) -> Damage:
    nodes = [n for n in layout.db_nodes("meta") if n.key.startswith(b"ns:")]
    node = nodes[int(rng.integers(len(nodes)))]
    where = undecodable_first_byte(path, layout, node, rng)
    return Damage(f"namespace entry {node.key!r} undecodable: {where}", min_served=len(tpl.keys), require_puts=True)


def redirect(path: Path, layout: lp.Layout, rng: np.random.Generator, tpl: Template) -> Damage:
    """Key A's leaf node now names key B's overflow pages: LMDB hands out B's frame for A."""
    nodes = [n for n in layout.db_nodes("payload") if n.overflow is not None]
    a, b = (nodes[int(i)] for i in rng.choice(len(nodes), 2, replace=False))
    assert a.overflow is not None and b.overflow is not None
    lp.overwrite(path, a.value_at, b.overflow.to_bytes(8, "little"))
    return Damage(
        f"overflow page number of {t.describe_key(a.key)} ({a.size} B frame) set to that of "
        f"{t.describe_key(b.key)} ({b.size} B frame)",
        min_served=len(tpl.keys) - 1,
    )


# ---- trials ------------------------------------------------------------------------------------


@dataclass
class Chain:
    """What the CLI made of one copy of a damaged store."""

    problems: list[str] = field(default_factory=list)
    crashed: bool = False
    unopenable: bool = False  # refused with a clear error: nothing to repair
    sound: bool = False  # verify said sound after --repair


@dataclass
class Trial:
    name: str
    damage: Damage
    served_dir: Path  # the damaged store, then used by a server (the probe), then repaired
    tool_dir: Path  # a copy of the damaged store for the tools
    tools: Chain = field(default_factory=Chain)
    after_use: Chain = field(default_factory=Chain)


def copy_store(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    shutil.copyfile(src / lp.DATA_FILE, dst / lp.DATA_FILE)
    return dst


def make_trial(tpl: Template, damager: Damager, name: str, seed: int, work: Path) -> Trial:
    damaged = copy_store(tpl.path, work / f"{name}-{seed}")
    layout = lp.read_layout(damaged)
    damage = damager(damaged, layout, np.random.default_rng(seed), tpl)
    tools = copy_store(damaged, work / f"{name}-{seed}-tools")
    return Trial(f"{name} seed={seed}", damage, damaged, tools)


def tool_chain(path: Path, *, survey: bool, export: bool = False, openable: bool = False) -> Chain:
    """``survey``: verify and inspect (and ``export``) first (the store may be refused cleanly,
    then every tool must refuse it); always verify --repair then verify, which must say sound.
    ``openable``: a server opened the store, so a tool must not refuse it."""
    chain = Chain()
    runs = []
    if survey:
        first = t.cli("verify", "--json", str(path))
        runs = [(first, {0, 1}), (t.cli("inspect", "--json", str(path)), {0})]
        if export:
            archive = str(path.parent / f"{path.name}.kva")
            runs.append((t.cli("export", "--json", str(path), archive), {0}))
        chain.unopenable = first.clean_error
    repair = t.cli("verify", "--json", "--repair", str(path))
    again = t.cli("verify", "--json", str(path))
    for run, allowed in [*runs, (repair, {0, 1}), (again, {0, 1})]:  # exit 1: bad records
        if (why := run.crash(allowed)) is not None:
            chain.crashed = True
            chain.problems.append(f"`{run.command}` crashed: {why}")
    if not survey and not openable:
        chain.unopenable = repair.clean_error
    if chain.unopenable:
        chain.problems += [f"not refused like verify did: {r.describe()}" for r in (repair, again) if not r.clean_error]
        return chain
    chain.sound = again.rc == 0 and again.report.get("status") == "sound"
    if repair.rc != 0:
        chain.problems.append(f"verify --repair failed: {repair.describe()}")
    if not chain.sound:
        chain.problems.append(f"verify after --repair does not say sound: {again.describe()}")
    return chain


def probe_problems(what: str, report: dict[str, Any], *, fresh: int, damage: Damage | None,
                   sound: bool, keys: int) -> list[str]:
    problems = [f"{what}: {p}" for p in t.probe_failures(report)]
    if report.get("crash") or report.get("open") is not None:
        return problems
    if damage is not None and report["first_served"] < damage.min_served:
        problems.append(f"{what}: served {report['first_served']} of {keys} records on the first "
                        f"pass; at least {damage.min_served} are intact")
    if damage is not None and damage.max_served is not None and report["first_served"] > damage.max_served:
        problems.append(f"{what}: served {report['first_served']} of {keys} records on the first "
                        f"pass; {keys - damage.max_served} are damaged and must be detected")
    if (sound or (damage is not None and damage.require_puts)) and report["admitted"] != fresh:
        problems.append(f"{what}: admitted {report['admitted']} of {fresh} new records")
    if sound and (report["lost"] or report["fresh_served"] != fresh):
        problems.append(
            f"{what}: after {fresh} puts (no eviction) {len(report['lost'])} records served "
            f"before were lost and {report['fresh_served']} of the new ones are served"
        )
    return problems


def run_trials(tally_name: str, trials: list[Trial], tpl: Template, export: bool) -> list[str]:
    """Per trial: a server (probe) uses the damaged store while the tools survey and repair a
    copy; then the tools repair the used store; then probes read both repaired stores. Tallies,
    and returns one message per failed trial (with its seed and damage)."""
    def job(tr: Trial, path: Path, **kw: Any) -> dict[str, Any]:
        return t.probe_job(f"{tr.name} @ {path}", path, tpl.keys, suspects=tr.damage.suspects, **kw)

    with ThreadPoolExecutor(1) as prober, ThreadPoolExecutor(2) as pool:  # 2 tool chains
        probing = prober.submit(t.run_probes, [
            job(tr, tr.served_dir, budget=tpl.stored_bytes + 3 * 8192, fresh=FRESH) for tr in trials
        ])
        surveyed = list(pool.map(lambda tr: tool_chain(tr.tool_dir, survey=True, export=export), trials))
        used = probing.result()
        opened = [used[job(tr, tr.served_dir)["id"]].get("open") is None for tr in trials]
        after_use = list(pool.map(
            lambda tr, ok: tool_chain(tr.served_dir, survey=False, openable=ok), trials, opened
        ))
    for tr, tools, after in zip(trials, surveyed, after_use, strict=True):
        tr.tools, tr.after_use = tools, after
    repaired = t.run_probes([
        job(tr, path, fresh=4, fresh_first=FRESH)  # records the first probe did not put
        for tr in trials
        for path, chain in ((tr.tool_dir, tr.tools), (tr.served_dir, tr.after_use))
        if not chain.unopenable
    ])
    tal = t.tally(tally_name)
    failures = []
    for tr in trials:
        report = used[job(tr, tr.served_dir)["id"]]
        problems = probe_problems("damaged store in use", report, fresh=FRESH, damage=tr.damage,
                                  sound=False, keys=len(tpl.keys))
        if tr.tools.unopenable and not report.get("crash") and report.get("open") is None:
            problems.append("the tools refused a store a server opened")
        reports = [report]
        for what, path, chain in (("tools on a copy", tr.tool_dir, tr.tools),
                                  ("tools after use", tr.served_dir, tr.after_use)):
            problems += [f"{what}: {p}" for p in chain.problems]
            after = repaired.get(job(tr, path)["id"])
            if after is not None:
                problems += probe_problems(f"{what}, repaired store", after, fresh=4, damage=None,
                                           sound=chain.sound, keys=len(tpl.keys))
                reports.append(after)
        tal.trials += 1
        tal.served += sum(r.get("served", 0) for r in reports)
        tal.detected += sum(r.get("detected", 0) for r in reports)
        tal.wrong += sum(len(r.get("wrong", [])) for r in reports)
        tal.crashed += int(tr.tools.crashed or tr.after_use.crashed or any(map(t.crashed, reports)))
        if problems:
            failures.append(f"[{tr.name}] {tr.damage.what}\n    " + "\n    ".join(problems))
    return failures


def check(tally_name: str, tpl: Template, plan: list[tuple[str, Damager]], work: Path,
          *, export: bool = False) -> None:
    trials = [
        make_trial(tpl, damager, name, t.seed_for(name, i), work)
        for i, (name, damager) in enumerate(plan)
    ]
    failures = run_trials(tally_name, trials, tpl, export)
    assert not failures, (
        f"{len(failures)} of {len(trials)} trials broke the contract "
        f"(seeds from KVSTRATA_RELIABILITY_SEED={t.BASE_SEED}):\n" + "\n".join(failures)
    )


# ---- tests -------------------------------------------------------------------------------------


def test_flipped_payload_bytes_are_misses_never_wrong_bytes(template: Template, tmp_path: Path) -> None:
    plan = [("payload", payload_frames)] * t.trials(2)
    check("byte flips: payload frames", template, plan, tmp_path)


STRUCTURE = [
    "meta", "branch", "leaf", "payload key", "index key", "overflow number", "overflow header",
    "anywhere",
]


def test_flipped_lmdb_structure_never_serves_wrong_bytes_or_crashes(
    template: Template, tmp_path: Path
) -> None:
    plan = [(kind, structure(kind)) for kind in STRUCTURE * t.trials(1)]
    check("byte flips: lmdb structure", template, plan, tmp_path)


@pytest.mark.parametrize("record", ["totals", "index record", "namespace"])
def test_undecodable_meta_or_index_record(template: Template, tmp_path: Path, record: str) -> None:
    damager = {"totals": totals, "index record": index_record, "namespace": namespace}[record]
    plan = [(record, damager)] * t.trials(1)
    check("byte flips: meta/index records", template, plan, tmp_path, export=True)


@pytest.mark.parametrize("codec", ["raw", "auto"])
def test_redirected_overflow_page_number_is_a_miss_not_another_keys_bytes(
    template: Template, raw_template: Template, tmp_path: Path, codec: str
) -> None:
    tpl = raw_template if codec == "raw" else template
    check("redirected overflow page", tpl, [(f"redirect-{codec}", redirect)] * t.trials(1), tmp_path)
