"""Block lists and block transfers (docs/BLOCKS.md): register_blocks, write_blocks / read_blocks in
the sync, asyncio and session forms, against two real daemons; indices and layouts packed
compactly; bad input refused naming the field."""

from __future__ import annotations

import asyncio
import struct

import numpy as np
import pytest

import tcpxd
from tcpxd import _blocks

MIB = 1 << 20
BS = 4096
N = 64


def test_layouts_are_packed_compactly():
    kind, m = _blocks.layout(range(0, 10 * BS, BS), block_size=BS)
    assert kind == "strided" and (m.first, m.stride, m.length, m.count) == (0, BS, BS, 10)
    kind, m = _blocks.layout(np.array([100, 300, 500]), 64)
    assert kind == "strided" and (m.first, m.stride, m.count) == (100, 200, 3)
    kind, m = _blocks.layout([0, 8192, 4096], [4096] * 3)
    assert kind == "uniform" and m.length == 4096 and np.frombuffer(m.offsets, "<u8").tolist() == [0, 8192, 4096]
    kind, m = _blocks.layout([0, 10], [5, 7])
    assert kind == "explicit" and np.frombuffer(m.lengths, "<u4").tolist() == [5, 7]
    with pytest.raises(tcpxd.InvalidArgument, match="lengths: 1 lengths for 2 offsets"):
        _blocks.layout([0, 10], [5])
    with pytest.raises(tcpxd.InvalidArgument, match="exactly one of lengths or block_size"):
        _blocks.layout([0], 5, block_size=5)
    with pytest.raises(tcpxd.InvalidArgument, match=r"offsets\[1\]: -3 is negative"):
        _blocks.layout([0, -3], 5)


def test_indices_travel_as_ranges_when_smaller():
    r = _blocks.pack_indices(range(5, 1005), "local_indices")
    assert r.encoding == _blocks.RANGES and struct.unpack("<II", r.data) == (5, 1000)
    runs = np.concatenate([np.arange(0, 100), np.arange(200, 300)])
    r = _blocks.pack_indices(runs, "local_indices")
    assert r.encoding == _blocks.RANGES and struct.unpack("<4I", r.data) == (0, 100, 200, 100)
    r = _blocks.pack_indices([3, 1, 2], "remote_indices")
    assert r.encoding == _blocks.U32 and struct.unpack("<3I", r.data) == (3, 1, 2)
    with pytest.raises(tcpxd.InvalidArgument, match="remote_indices: at least one block"):
        _blocks.pack_indices([], "remote_indices")
    with pytest.raises(tcpxd.InvalidArgument, match=r"local_indices\[1\]: 4294967296 exceeds"):
        _blocks.pack_indices([0, 1 << 32], "local_indices")
    with pytest.raises(tcpxd.InvalidArgument, match=r"local_indices\[0\]: -2 is negative"):
        _blocks.pack_indices(range(-2, 5), "local_indices")


def test_indices_from_torch_tensors():
    torch = pytest.importorskip("torch")
    r = _blocks.pack_indices(torch.arange(10, 20), "local_indices")
    assert r.encoding == _blocks.RANGES and struct.unpack("<II", r.data) == (10, 10)


@pytest.fixture
def pair(peered):
    a, b = peered
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        yield ca, cb


def test_lists_register_describe_and_release(pair):
    ca, _ = pair
    with ca.register_host(MIB, shared=False) as buf:
        with ca.register_blocks(buf, block_size=BS) as whole:
            assert len(whole) == MIB // BS and whole.block_length == BS
            assert whole.token.startswith(f"tcpxd1b:pa:{whole.id}:{MIB // BS}:{BS}:")
        assert whole.released
        scattered = ca.register_blocks(buf, np.array([0, 9000, 5000]), np.array([10, 20, 30], dtype=np.uint32))
        assert (len(scattered), scattered.block_length) == (3, 0)
        old = scattered.token
        buf.rekey()
        assert scattered.refresh() != old
        with pytest.raises(tcpxd.InvalidArgument, match=r"offsets\[0\]: offset 1048000 \+ length 4096 exceeds"):
            ca.register_blocks(buf, [MIB - 576], block_size=BS)
        with pytest.raises(tcpxd.InvalidArgument, match="overlap"):
            ca.register_blocks(buf, [0, 100], block_size=BS)
        scattered.release()
        with pytest.raises(tcpxd.NotFound, match="list_id"):
            scattered.refresh()


def blocks(data: bytes, offsets, idx):
    return [data[offsets[i] : offsets[i] + BS] for i in idx]


def scattered_lists(ca, cb, seed: int):
    """A source list (strided with gaps) in a's buffer and a destination list (uniform at
    permuted slots, odd offsets) in b's; the source filled."""
    rng = np.random.default_rng(seed)
    src = ca.register_host(MIB, shared=False)
    dst = cb.register_host(MIB, shared=False)
    src.fill(seed=seed)
    soffs = [i * (BS + 512) for i in range(N)]
    doffs = [7 + int(s) * BS for s in rng.permutation(N)]
    sl = ca.register_blocks(src, range(0, N * (BS + 512), BS + 512), block_size=BS)
    dl = cb.register_blocks(dst, np.array(doffs), BS)
    return src, dst, sl, dl, soffs, doffs, rng


@pytest.mark.parametrize("form", ["unary", "session"])
def test_write_and_read_blocks_land_pair_by_pair(pair, form):
    ca, cb = pair
    src, dst, sl, dl, soffs, doffs, rng = scattered_lists(ca, cb, 21)
    li, ri = rng.permutation(N), rng.permutation(N)
    if form == "unary":
        r = ca.write_blocks(sl, li, dl.token, ri, notification=b"kv")
    else:
        with ca.session() as s:
            r = s.write_blocks(sl, li, dl, ri).result(timeout=60)
    assert r.total_bytes == N * BS
    sd, dd = src.read_bytes(), dst.read_bytes()
    assert blocks(sd, soffs, li) == blocks(dd, doffs, ri)
    assert dd[:7] == bytes(7)
    # READ back: b's blocks (a range) into a second list of a's.
    with ca.register_host(MIB, shared=False) as back, ca.register_blocks(back, block_size=BS) as bl:
        idx = list(range(N))
        if form == "unary":
            ca.read_blocks(bl, range(N), dl, idx)
        else:
            with ca.session() as s:
                s.read_blocks(bl, range(N), dl, idx).result(timeout=60)
        bd = back.read_bytes(0, N * BS)
        assert blocks(bd, [i * BS for i in range(N)], idx) == blocks(dd, doffs, idx)
    for x in (sl, dl, src, dst):
        x.release()


def test_async_write_and_read_blocks(peered):
    a, b = peered

    async def main():
        async with tcpxd.AsyncClient(a.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            src = await ca.register_host(MIB, shared=False)
            dst = await cb.register_host(MIB, shared=False)
            await src.fill(seed=5)
            sl = await ca.register_blocks(src, block_size=BS)
            async with await cb.register_blocks(dst, block_size=BS) as dl:
                r = await ca.write_blocks(sl, [3, 1, 2], dl.token, range(10, 13))
                assert r.total_bytes == 3 * BS
                async with ca.session() as s:
                    await s.write_blocks(sl, [0], dl, [0])
                sd, dd = await src.read_bytes(), await dst.read_bytes()
                assert dd[10 * BS : 13 * BS] == sd[3 * BS : 4 * BS] + sd[BS : 2 * BS] + sd[2 * BS : 3 * BS]
                assert dd[:BS] == sd[:BS]
            assert dl.released
            await sl.release()
            await src.release()
            await dst.release()

    asyncio.run(main())


def test_block_transfers_refuse_bad_input_naming_the_field(pair):
    ca, cb = pair
    with ca.register_host(MIB, shared=False) as src, cb.register_host(MIB, shared=False) as dst:
        sl = ca.register_blocks(src, block_size=BS)
        dl = cb.register_blocks(dst, block_size=BS)
        with pytest.raises(tcpxd.InvalidArgument, match="remote_token: malformed block-list token"):
            ca.write_blocks(sl, [0], "tcpxd1b:nope", [0])
        # A list of this node is carried by the daemon itself (test_nixl_same_node.py), with the
        # same checks: a destination block named twice.
        with pytest.raises(tcpxd.InvalidArgument, match=r"local_indices\[1\]: block 0 is already named"):
            ca.read_blocks(sl, [0, 0], sl, [1, 2])
        with pytest.raises(tcpxd.InvalidArgument, match="local_indices: at least one block"):
            ca.write_blocks(sl, [], dl, [0])
        with ca.session() as s:
            with pytest.raises(tcpxd.InvalidArgument, match="remote_token: malformed"):
                s.write_blocks(sl, [0], "x", [0]).result(timeout=30)
        assert dst.read_bytes() == bytes(MIB)


def test_prepared_requests_are_checked_and_packed():
    r = _blocks.prepare_request([3, 4], np.array([[0, 0, 2], [1, 5, 1]]))
    assert list(r.local_list_ids) == [3, 4] and np.frombuffer(r.entries, "<u4").tolist() == [0, 0, 2, 1, 5, 1]
    r = _blocks.prepare_request(["tcpxd1b:x"], [[0, 1, 1]])
    assert list(r.remote_tokens) == ["tcpxd1b:x"]
    with pytest.raises(tcpxd.InvalidArgument, match="lists: give this node's lists"):
        _blocks.prepare_request([3, "tcpxd1b:x"], [[0, 0, 1]])
    with pytest.raises(tcpxd.InvalidArgument, match=r"entries: an N×3 array"):
        _blocks.prepare_request([3], [0, 0, 1])
    with pytest.raises(tcpxd.InvalidArgument, match=r"entries\[1\]: -1 is outside"):
        _blocks.prepare_request([3], [[0, 0, 1], [0, -1, 1]])
    w = _blocks.prepared_request("WRITE", 7, [2, 0], 9, np.array([1, 1]), b"n", None, False)
    assert (w.local_prepared_id, w.remote_prepared_id, w.notification) == (7, 9, b"n")
    assert np.frombuffer(w.local_indices, "<u4").tolist() == [2, 0]
    with pytest.raises(tcpxd.InvalidArgument, match="remote_indices: at least one entry"):
        _blocks.prepared_request("READ", 7, [0], 9, [], b"", None, False)


def _prepared_pair(ca, cb, seed):
    """Two buffers a side, each with a 4 KiB block list; prepared lists of 2-block entries over
    both lists of each side (a's local, b's prepared on a from the tokens)."""
    rng = np.random.default_rng(seed)
    srcs = [ca.register_host(MIB, shared=False) for _ in range(2)]
    dsts = [cb.register_host(MIB, shared=False) for _ in range(2)]
    for i, s in enumerate(srcs):
        s.fill(seed=seed + i)
    sls = [ca.register_blocks(s, block_size=BS) for s in srcs]
    dls = [cb.register_blocks(d, block_size=BS) for d in dsts]
    per = MIB // BS // 2  # entries of 2 blocks per list
    ent = np.array([(k, 2 * i, 2) for k in range(2) for i in range(per)])
    return rng, srcs, dsts, sls, dls, ent, per


def _entry_bytes(bufs, per, e):
    k, i = divmod(int(e), per)
    return bufs[k][2 * i * BS:(2 * i + 2) * BS]


@pytest.mark.parametrize("form", ["unary", "session"])
def test_prepared_transfers_land_and_notify_once(pair, form):
    ca, cb = pair
    rng, srcs, dsts, sls, dls, ent, per = _prepared_pair(ca, cb, 31)
    li, ri = rng.permutation(2 * per)[:40], rng.permutation(2 * per)[:40]
    with cb.subscribe() as sub:
        if form == "unary":
            lp = ca.prepare_blocks(sls, ent)
            rp = ca.prepare_blocks([d.token for d in dls], ent)
            assert (len(lp), lp.blocks) == (2 * per, 4 * per)
            r = ca.write_prepared(lp, li, rp, ri, notification=b"kv landed")
        else:
            with ca.session() as s:
                lp = s.prepare_blocks(sls, ent)
                rp = s.prepare_blocks([d.token for d in dls], ent)
                r = s.write_prepared(lp, li, rp, ri, notification=b"kv landed").result(timeout=60)
        assert r.total_bytes == 40 * 2 * BS
        n = sub.next(timeout=30)
        assert n.payload == b"kv landed"
    sd = [s.read_bytes() for s in srcs]
    dd = [d.read_bytes() for d in dsts]
    for x, y in zip(li, ri):
        assert _entry_bytes(sd, per, x) == _entry_bytes(dd, per, y)
    if form == "unary":
        # READ back into the other entries, its notification to b once the bytes landed here.
        with cb.subscribe() as sub:
            back = rng.permutation(2 * per)[:40]
            ca.read_prepared(lp, back, rp, ri, notification=b"read done")
            assert sub.next(timeout=30).payload == b"read done"
        sd = [s.read_bytes() for s in srcs]
        for x, y in zip(back, ri):
            assert _entry_bytes(sd, per, x) == _entry_bytes(dd, per, y)
        with pytest.raises(tcpxd.InvalidArgument, match=r"local_indices\[1\]"):
            ca.write_prepared(lp, [0, 2 * per], rp, [0, 1])
        lp.release()
        with pytest.raises(tcpxd.NotFound):
            ca.write_prepared(lp, [0], rp, [0])
        rp.release()
    else:  # the session's lists went with it
        with pytest.raises(tcpxd.NotFound):
            ca.write_prepared(lp, [0], rp, [0])
    for x in sls + dls + srcs + dsts:
        x.release()


def test_async_prepared_transfers(peered):
    a, b = peered

    async def main():
        async with tcpxd.AsyncClient(a.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            src = await ca.register_host(MIB, shared=False)
            dst = await cb.register_host(MIB, shared=False)
            await src.fill(seed=8)
            sl = await ca.register_blocks(src, block_size=BS)
            dl = await cb.register_blocks(dst, block_size=BS)
            ent = [(0, i, 1) for i in range(16)]
            async with await ca.prepare_blocks([sl], ent) as lp, await ca.prepare_blocks([dl.token], ent) as rp:
                r = await ca.write_prepared(lp, [3, 1], rp, [10, 11])
                assert r.total_bytes == 2 * BS
                async with ca.session() as s:
                    sp = await s.prepare_blocks([sl], ent)
                    await s.write_prepared(sp, [5], rp, [0])
                sd, dd = await src.read_bytes(), await dst.read_bytes()
                assert dd[10 * BS:12 * BS] == sd[3 * BS:4 * BS] + sd[BS:2 * BS]
                assert dd[:BS] == sd[5 * BS:6 * BS]
            for x in (sl, dl, src, dst):
                await x.release()

    asyncio.run(main())
