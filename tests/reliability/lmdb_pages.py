"""Where LMDB keeps what inside ``data.mdb``: a read-only walker of the live pages (LMDB 0.9).

The torture tests damage a store the way a disk does, by flipping bytes in the file, but aim at
structures: the meta pages, branch and leaf pages, the overflow page number a leaf node holds for
a large value, one record's value. This module finds them by walking the B-trees from the current
meta page, the way LMDB itself does (``mdb.c``: ``MDB_meta``, ``MDB_db``, ``MDB_page``,
``MDB_node``), and never touches kvstrata's code.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

DATA_FILE = "data.mdb"
PAGE_HEADER = 16  # pgno u64, pad u16, flags u16, lower u16, upper u16 (or overflow count u32)
P_BRANCH, P_LEAF = 0x01, 0x02  # page flags
F_BIGDATA = 0x01  # node flag: the value lies in overflow pages
META_MAGIC = 0xBEEFC0DE
META_END = 152  # the MDB_meta struct ends here, counted from the start of its page
NO_PAGE = 2**64 - 1

_PAGE = struct.Struct("<QHHHH")
_META = struct.Struct("<II")  # magic, version (at PAGE_HEADER)
_DB = struct.Struct("<IHHQQQQQ")  # pad(=page size in the free DB), flags, depth, 3 counts, entries, root
_DBS_AT = PAGE_HEADER + 24  # mm_dbs[FREE_DBI], then mm_dbs[MAIN_DBI]
_TXNID_AT = _DBS_AT + 2 * _DB.size + 8
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, key size


@dataclass(frozen=True)
class Leaf:
    """One leaf node: a key and its value (inline, or in a run of overflow pages)."""

    db: str
    page: int
    key: bytes
    key_at: int  # file offset of the key
    value_at: int  # file offset of the inline value, or of the 8-byte overflow page number
    size: int  # the value's size
    overflow: int | None  # first overflow page of a large value


@dataclass
class Layout:
    """The live pages of one ``data.mdb``, by kind and database."""

    psize: int
    file_size: int
    meta: int  # the current meta page: 0 or 1
    branches: dict[int, str] = field(default_factory=dict)  # pgno -> database
    leaves: dict[int, str] = field(default_factory=dict)
    overflows: dict[int, int] = field(default_factory=dict)  # first pgno -> pages in the run
    nodes: list[Leaf] = field(default_factory=list)
    bounds: dict[int, tuple[int, int]] = field(default_factory=dict)  # pgno -> (lower, upper)

    def db_nodes(self, db: str) -> list[Leaf]:
        return [n for n in self.nodes if n.db == db]

    def node(self, db: str, key: bytes) -> Leaf:
        found = [n for n in self.nodes if n.db == db and n.key == key]
        assert len(found) == 1, f"{len(found)} live leaf nodes for {key!r} in {db}"
        return found[0]

    def value_range(self, leaf: Leaf) -> tuple[int, int]:
        """File offsets ``[start, end)`` of the node's value bytes."""
        if leaf.overflow is None:
            return leaf.value_at, leaf.value_at + leaf.size
        start = leaf.overflow * self.psize + PAGE_HEADER
        return start, start + leaf.size

    def used_bytes(self, pgno: int) -> list[tuple[int, int]]:
        """File ranges of a branch or leaf page that hold something: header + node pointers,
        and the nodes (between them lies the page's free space)."""
        base = pgno * self.psize
        lower, upper = self.bounds[pgno]
        return [(base, base + lower), (base + upper, base + self.psize)]

    def keys_at(self, offset: int) -> list[tuple[Leaf, int]]:
        """Leaf nodes whose key covers file ``offset``, with the index of the byte in the key."""
        return [
            (n, offset - n.key_at) for n in self.nodes if n.key_at <= offset < n.key_at + len(n.key)
        ]


def read_layout(path: Path) -> Layout:
    """Walk every tree of the store at ``path`` (free list, main, named databases)."""
    data = (path / DATA_FILE).read_bytes()
    psize = _DB.unpack_from(data, _DBS_AT)[0]
    metas = []
    for i in (0, 1):
        base = i * psize
        magic, _ = _META.unpack_from(data, base + PAGE_HEADER)
        assert magic == META_MAGIC, f"meta page {i} has no LMDB magic"
        metas.append((struct.unpack_from("<Q", data, base + _TXNID_AT)[0], i))
    meta = max(metas)[1]
    layout = Layout(psize=psize, file_size=len(data), meta=meta)
    free_root = _DB.unpack_from(data, meta * psize + _DBS_AT)[-1]
    main_root = _DB.unpack_from(data, meta * psize + _DBS_AT + _DB.size)[-1]
    _walk(data, layout, free_root, "free")
    _walk(data, layout, main_root, "main")
    for node in layout.db_nodes("main"):  # the named databases: their MDB_db records
        _walk(data, layout, _DB.unpack_from(data, node.value_at)[-1], node.key.decode())
    return layout


def _walk(data: bytes, layout: Layout, pgno: int, db: str) -> None:
    if pgno == NO_PAGE:
        return
    psize = layout.psize
    base = pgno * psize
    got, _, flags, lower, upper = _PAGE.unpack_from(data, base)
    assert got == pgno, f"page {pgno} of {db} says it is page {got}"
    layout.bounds[pgno] = (lower, upper)
    count = (lower - PAGE_HEADER) // 2
    ptrs = struct.unpack_from(f"<{count}H", data, base + PAGE_HEADER)
    if flags & P_BRANCH:
        layout.branches[pgno] = db
        for ptr in ptrs:
            lo, hi, high, _ = _NODE.unpack_from(data, base + ptr)
            _walk(data, layout, lo | hi << 16 | high << 32, db)
        return
    assert flags & P_LEAF, f"page {pgno} of {db} is neither a branch nor a leaf ({flags:#x})"
    layout.leaves[pgno] = db
    for ptr in ptrs:
        at = base + ptr
        lo, hi, nflags, ksize = _NODE.unpack_from(data, at)
        key_at = at + _NODE.size
        value_at = key_at + ksize
        size = lo | hi << 16
        overflow = None
        if nflags & F_BIGDATA:
            overflow = struct.unpack_from("<Q", data, value_at)[0]
            layout.overflows[overflow] = struct.unpack_from("<I", data, overflow * psize + 12)[0]
        key = data[key_at:value_at]
        layout.nodes.append(Leaf(db, pgno, key, key_at, value_at, size, overflow))


def flip(path: Path, offset: int, mask: int) -> None:
    """XOR the byte at ``offset`` of ``data.mdb`` with ``mask`` (in place)."""
    assert 0 < mask < 256
    with open(path / DATA_FILE, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


def overwrite(path: Path, offset: int, new: bytes) -> None:
    with open(path / DATA_FILE, "r+b") as f:
        f.seek(offset)
        f.write(new)
