"""A descriptor is all a client needs: DescribeNode, and transfers to another daemon's descriptor
with no connect_peer call (the daemon connects on first use)."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

import tcpxd
from conftest import start_daemon, stop_daemon

MIB = 1 << 20


@pytest.fixture(scope="module")
def strangers(tmp_root):
    """Two daemons that have never met (no connect_peer from either side)."""
    a = start_daemon(tmp_root, "na")
    b = start_daemon(tmp_root, "nb")
    yield a, b
    for d in (a, b):
        stop_daemon(d)


def test_describe_node_says_how_to_reach_the_node(strangers):
    a, _ = strangers
    with tcpxd.Client(a.endpoint) as c:
        n = c.describe_node()
        assert isinstance(n, tcpxd.NodeInfo)
        assert n.node_id == "na"
        assert n.peer_addresses == [a.peer_address] == a.ready["peer_addresses"]
        assert n.version and n.plugin_name and n.plugin_path == "built-in emulation"
        assert n.devices and all(isinstance(d, tcpxd.NetDevice) and d.host_memory for d in n.devices)
        assert all(isinstance(g, tcpxd.GpuDevice) for g in n.gpus)
        assert n.lanes_per_device >= 1 and n.chunk_bytes >= 4096 and n.peer_protocol_version >= 1
        with c.register_host(4096) as buf:
            assert buf.descriptor.endswith("@" + ",".join(n.peer_addresses))


def test_node_info_carries_topology_protocol_and_instance(strangers):
    a, b = strangers
    with tcpxd.Client(a.endpoint) as c, tcpxd.Client(b.endpoint) as cb:
        n, m = c.describe_node(), cb.describe_node()
        raw = n.raw
        assert n.transfer_protocol == raw.transfer_protocol and n.transfer_protocol in ("eager", "rendezvous", "auto")
        assert (n.eager_lanes_per_device, n.eager_max_bytes) == (raw.eager_lanes_per_device, raw.eager_max_bytes)
        if n.transfer_protocol != "auto":
            assert n.eager_lanes_per_device == 0 and n.eager_max_bytes == 0
        # The emulation has no GPUs: no GPU-to-NIC map, and it says so.
        assert n.gpus == [] and n.gpu_nics == [] and n.topology_source == raw.topology_source == "none"
        assert len(n.instance_id) == 32 and int(n.instance_id, 16) >= 0 and n.instance_id != m.instance_id
        assert n.instance_id == c.describe_node().instance_id  # the same process: the same instance
        assert isinstance(n.reattach_grace_s, int) and n.reattach_grace_s == raw.reattach_grace_s
        assert n.inline_max_bytes == raw.inline_max_bytes > 0 and n.inline_window_bytes == raw.inline_window_bytes > 0
    # A map as a GPU node reports it: typed, in the message's order.
    msg = type(raw)(topology_source="pci")
    g = msg.gpu_nics.add(gpu_ordinal=1, gpu_pci_bus_id="0000:0a:00.0", relation="same PCIe switch")
    g.nic_devices.extend([2, 3])
    g.nic_names.extend(["eth2", "eth3"])
    info = tcpxd._ops.node_info(msg)
    assert info.gpu_nics == [tcpxd.GpuNics(1, "0000:0a:00.0", [2, 3], ["eth2", "eth3"], "same PCIe switch")]
    assert info.topology_source == "pci"


def test_node_info_reports_the_inline_settings_the_daemon_was_given(tmp_root):
    d = start_daemon(tmp_root, "ni", ["--inline-max-bytes", "4096", "--inline-window-bytes", "8192",
                                      "--inline-gpu", "on", "--inline-gpu-in-flight", "2"])
    try:
        with tcpxd.Client(d.endpoint) as c:
            n = c.describe_node()
        assert (n.inline_max_bytes, n.inline_window_bytes, n.inline_gpu, n.inline_gpu_in_flight) == (4096, 8192, True, 2)
        assert "inline_small_transfers" in n.features
    finally:
        stop_daemon(d)


def test_a_write_to_another_daemons_descriptor_needs_no_connect_peer(strangers):
    a, b = strangers
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        assert ca.list_peers() == [] and cb.list_peers() == []
        with ca.register_host(4 * MIB) as src, cb.register_host(4 * MIB) as dst, ca.register_host(MIB) as back:
            src.fill(seed=9)
            # Eight writes at once, all of them first uses: one pairing, every byte lands.
            errors = []

            def one(i: int) -> None:
                try:
                    ca.write(src, dst.descriptor, MIB // 2, local_offset=i * MIB // 2, remote_offset=i * MIB // 2)
                except Exception as e:  # noqa: BLE001 - reported below
                    errors.append(e)

            ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            assert not errors, errors
            assert dst.checksum() == src.checksum()
            assert [p.node_id for p in ca.list_peers()] == ["nb"]
            assert [p.node_id for p in cb.list_peers()] == ["na"]
            assert [p.node_id for p in ca.stats().peers] == ["nb"], "one pairing"
            # The other way round, a READ through a's descriptor.
            cb.read(src.descriptor, dst, MIB, remote_offset=MIB)
            ca.read(dst.descriptor, back, MIB)
            assert back.read_bytes() == src.read_bytes(MIB, MIB)


def test_an_unreachable_descriptor_address_raises_unavailable_naming_it(strangers):
    a, b = strangers
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = f"127.0.0.1:{s.getsockname()[1]}"
    s.close()
    with tcpxd.Client(a.endpoint) as ca, tcpxd.Client(b.endpoint) as cb:
        with ca.register_host(MIB) as src, cb.register_host(MIB) as dst:
            head = dst.descriptor.split("@")[0].replace(":nb:", ":nowhere:", 1)
            with pytest.raises(tcpxd.Unavailable) as e:
                ca.write(src, f"{head}@{closed}", 4096)
            assert closed in e.value.message and "remote_descriptor" in e.value.message
            with pytest.raises(tcpxd.InvalidArgument, match=r"peer address\[0\]"):
                ca.write(src, f"{head}@0.0.0.0:50052", 4096)


def test_asyncio_client_describes_and_writes_by_descriptor(strangers):
    a, b = strangers

    async def go() -> None:
        async with tcpxd.AsyncClient(a.endpoint) as ca, tcpxd.AsyncClient(b.endpoint) as cb:
            n = await cb.describe_node()
            assert n.node_id == "nb" and n.peer_addresses == [b.peer_address]
            async with await ca.register_host(MIB) as src, await cb.register_host(MIB) as dst:
                await src.fill(byte=0x3C)
                r = await ca.write(src, dst.descriptor)
                assert r.bytes_done == MIB
                assert await dst.checksum() == await src.checksum()

    asyncio.run(go())
