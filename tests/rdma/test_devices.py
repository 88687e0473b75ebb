"""RDMA discovery: the real no-NIC path on this machine, parsing and the device choice."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from fd_routing_replay.rdma import devices as rdma
from fd_routing_replay.rdma.devices import (
    GidInfo,
    PortInfo,
    RdmaDevice,
    RdmaReport,
    choose_device,
    gid_from_entry,
    list_devices,
    port_from_attr,
    port_rate_gbps,
)

ZERO = "0000:0000:0000:0000:0000:0000:0000:0000"


# -- the real machine -----------------------------------------------------------------

def test_list_devices_never_raises_and_agrees_with_choice():
    report = list_devices()
    choice = choose_device("auto", report)
    assert report.tcp_only == (choice.protocol == "tcp")
    summary = report.summary()
    if report.tcp_only:
        assert summary.startswith("TCP only: ")
        assert choice.device is None and choice.reason.startswith("TCP only: ")
        assert report.reason in summary
    else:  # pragma: no cover - only on a node with an active RDMA port
        assert summary.startswith("RDMA available: ")
        assert choice.device in {device.name for device, _ in report.usable}
    json.dumps(report.to_dict())  # plain data, serialisable for `fd-rr doctor --json`


def test_pyverbs_missing_is_reported_not_raised():
    # A subprocess where importing pyverbs fails the way it does without the extra.
    code = ("import sys, json; sys.modules['pyverbs'] = None; "
            "from fd_routing_replay.rdma import list_devices, choose_device; "
            "r = list_devices(); c = choose_device('auto', r); "
            "print(json.dumps([r.tcp_only, r.pyverbs_available, r.reason, c.protocol, "
            "choose_device('mlx5_0', r).protocol, choose_device('mlx5_0', r).reason]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    tcp_only, available, reason, protocol, explicit, explicit_reason = json.loads(out.stdout)
    assert tcp_only and not available and protocol == "tcp"
    assert "pyverbs is not installed" in reason and "fd-routing-replay[verbs]" in reason
    # An explicit device cannot be verified without pyverbs: it is passed through.
    assert explicit == "rdma" and "not verified" in explicit_reason


# -- parsing objects shaped like pyverbs' ------------------------------------------------

class FakeGidEntry(SimpleNamespace):
    """Attribute names of pyverbs.device.GIDEntry (gid_str is a method there)."""

    def gid_str(self) -> str:
        return self.text


def port_attr(state=4, link_layer=1, speed=32, width=2, mtu=5, speed_ex=0, gid_tbl_len=4):
    return SimpleNamespace(state=state, link_layer=link_layer, active_speed=speed,
                           active_width=width, active_speed_ex=speed_ex, active_mtu=mtu,
                           lid=7, gid_tbl_len=gid_tbl_len)


@pytest.mark.parametrize(("speed", "width", "speed_ex", "expected"), [
    (1, 1, 0, 2.5), (32, 2, 0, 100.0), (64, 2, 0, 200.0), (128, 2, 0, 400.0),
    (16, 2, 0, 56.0), (8, 2, 0, 40.0), (32, 16, 0, 50.0), (0, 2, 256, 800.0),
    (3, 2, 0, None), (32, 3, 0, None)])
def test_port_rate(speed, width, speed_ex, expected):
    assert port_rate_gbps(speed, width, speed_ex) == expected


def test_port_from_attr_maps_codes():
    gids = [GidInfo(1, "fe80:0000:0000:0000:0000:0000:0000:0002", "RoCEv2"),
            GidInfo(0, "fe80:0000:0000:0000:0000:0000:0000:0001", "RoCEv1")]
    port = port_from_attr(1, port_attr(state=4, link_layer=2, mtu=3), gids)
    assert (port.state, port.link_layer, port.active_mtu, port.rate_gbps) == \
        ("ACTIVE", "Ethernet", 1024, 100.0)
    assert [g.index for g in port.gids] == [0, 1] and port.usable
    down = port_from_attr(2, port_attr(state=1))
    assert down.state == "DOWN" and not down.usable
    odd = port_from_attr(3, port_attr(state=9, link_layer=7, mtu=0))
    assert odd.state == "UNKNOWN(9)" and odd.link_layer == "unknown(7)" and odd.active_mtu == 0


def test_gid_from_entry():
    entry = FakeGidEntry(text="fe80:0000:0000:0000:0a00:27ff:fe00:0001", gid_type=2,
                         gid_index=3, port_num=1, ndev_ifindex=5)
    assert gid_from_entry(entry) == GidInfo(3, entry.text, "RoCEv2", 5)
    assert gid_from_entry(FakeGidEntry(text=ZERO, gid_type=0, gid_index=0, port_num=1,
                                       ndev_ifindex=0)) is None
    legacy = SimpleNamespace(gid="fe80:0000:0000:0000:0000:0000:0000:0009")  # ctx.query_gid()
    assert gid_from_entry(legacy, 4) == GidInfo(4, legacy.gid, "unknown", None)


class FakeContext:
    """Context(name=...) shaped like pyverbs': query_device/query_port/query_gid(_table)."""

    devices: dict = {}

    def __init__(self, name):
        if name not in self.devices:
            raise OSError(f"Failed to find device {name}")
        self.spec = self.devices[name]
        self.closed = False

    def query_device(self):
        return SimpleNamespace(phys_port_cnt=len(self.spec["ports"]), node_guid=0x1234,
                               fw_version="28.39.1002", vendor_id=0x2C9, vendor_part_id=4129)

    def query_port(self, number):
        return self.spec["ports"][number - 1]

    def query_gid_table(self, max_entries):
        if self.spec.get("no_table"):
            raise RuntimeError("Failed to query gid tables of the device")
        return self.spec["table"][:max_entries]

    def query_gid(self, port, index):
        return SimpleNamespace(gid=self.spec["legacy"].get((port, index), ZERO))

    def close(self):
        self.closed = True


def test_query_device_reads_table_and_falls_back_to_query_gid():
    module = SimpleNamespace(Context=FakeContext, guid_to_hex=lambda g: f"{g:016x}")
    FakeContext.devices = {
        "mlx5_0": {"ports": [port_attr(link_layer=2)], "table": [
            FakeGidEntry(text="fe80:0000:0000:0000:0000:0000:0000:0001", gid_type=1,
                         gid_index=0, port_num=1, ndev_ifindex=2),
            FakeGidEntry(text="fe80:0000:0000:0000:0000:0000:0000:0001", gid_type=2,
                         gid_index=1, port_num=1, ndev_ifindex=2)]},
        "mlx5_1": {"ports": [port_attr(), port_attr(state=1)], "no_table": True,
                   "legacy": {(1, 0): "fe80:0000:0000:0000:0000:0000:0000:00aa"}},
    }
    first = rdma._query_device(module, "mlx5_0", 8)
    assert first.error is None and first.fw_version == "28.39.1002"
    assert [g.type for g in first.ports[0].gids] == ["RoCEv1", "RoCEv2"]
    second = rdma._query_device(module, "mlx5_1", 8)
    assert [p.state for p in second.ports] == ["ACTIVE", "DOWN"]
    assert [g.gid for g in second.ports[0].gids] == ["fe80:0000:0000:0000:0000:0000:0000:00aa"]
    missing = rdma._query_device(module, "mlx5_9", 8)
    assert missing.error.startswith("cannot open") and "mlx5_9" in missing.error


# -- the choice ------------------------------------------------------------------------

def make_port(number, *, active=True, layer="InfiniBand", rate=100.0, gid_types=("IB",)):
    gids = tuple(GidInfo(i, f"fe80::{i}", t) for i, t in enumerate(gid_types))
    return PortInfo(number, "ACTIVE" if active else "DOWN", 4 if active else 1, layer, 4096,
                    rate, 1, gids)


def test_auto_picks_fastest_usable_port():
    report = RdmaReport(devices=(
        RdmaDevice("mlx5_0", ports=(make_port(1, rate=400.0, active=False),)),
        RdmaDevice("mlx5_1", ports=(make_port(1, rate=200.0),)),
        RdmaDevice("mlx5_2", ports=(make_port(1, rate=400.0, layer="Ethernet", gid_types=()),)),
        RdmaDevice("mlx5_3", ports=(make_port(1, rate=100.0),)),
    ))
    choice = choose_device("auto", report)
    assert (choice.device, choice.protocol, choice.ok) == ("mlx5_1", "rdma", True)
    assert "mlx5_1 port 1" in choice.reason and choice.candidates == ("mlx5_1", "mlx5_3")
    assert not report.tcp_only and report.summary().startswith("RDMA available")


def test_auto_tie_prefers_roce_v2_then_name():
    report = RdmaReport(devices=(
        RdmaDevice("mlx5_a", ports=(make_port(1, layer="Ethernet", gid_types=("RoCEv1",)),)),
        RdmaDevice("mlx5_b", ports=(make_port(1, layer="Ethernet", gid_types=("RoCEv2",)),)),
        RdmaDevice("mlx5_c", ports=(make_port(1, layer="Ethernet", gid_types=("RoCEv2",)),)),
    ))
    assert choose_device("auto", report).device == "mlx5_b"


def test_no_usable_port_is_tcp_only_with_reason():
    report = RdmaReport(devices=(RdmaDevice("mlx5_0", ports=(make_port(1, active=False),)),
                                 RdmaDevice("mlx5_1", error="cannot open: permission denied")))
    choice = choose_device("auto", report)
    assert choice.protocol == "tcp" and choice.device is None and choice.ok
    assert "mlx5_0: port 1: DOWN" in choice.reason and "permission denied" in choice.reason


def test_explicit_devices_are_checked():
    report = RdmaReport(devices=(RdmaDevice("mlx5_0", ports=(make_port(1),)),
                                 RdmaDevice("mlx5_1", ports=(make_port(1, active=False),))))
    assert choose_device("mlx5_0", report) == choose_device(" mlx5_0 ", report)
    assert choose_device("mlx5_0", report).device == "mlx5_0"
    missing = choose_device("mlx5_0,mlx5_7", report)
    assert not missing.ok and "mlx5_7 not found" in missing.reason
    assert "usable devices: mlx5_0" in missing.reason and missing.candidates == ("mlx5_0",)
    down = choose_device("mlx5_1", report)
    assert not down.ok and "mlx5_1 has no usable ACTIVE port" in down.reason


def test_auto_matches_reference_on_random_reports(rng):
    for _ in range(200):
        devices = []
        for d in range(rng.randint(0, 5)):
            ports = tuple(make_port(p + 1, active=rng.random() < 0.6,
                                    layer=rng.choice(["InfiniBand", "Ethernet"]),
                                    rate=rng.choice([None, 25.0, 100.0, 200.0, 400.0]),
                                    gid_types=rng.choice([(), ("RoCEv2",), ("IB",)]))
                          for p in range(rng.randint(0, 2)))
            devices.append(RdmaDevice(f"dev{d}", ports=ports))
        report = RdmaReport(devices=tuple(devices))
        usable = [(dev, port) for dev in devices for port in dev.ports
                  if port.state_code == 4 and (port.link_layer != "Ethernet" or port.gids)]
        choice = choose_device("auto", report)
        if not usable:
            assert choice.protocol == "tcp" and choice.device is None
            continue
        best_rate = max(port.rate_gbps or 0.0 for _, port in usable)
        winners = {dev.name for dev, port in usable if (port.rate_gbps or 0.0) == best_rate}
        assert choice.protocol == "rdma" and choice.device in winners


def test_without_pyverbs_auto_defers_to_kernel_devices(tmp_path):
    no_pyverbs = RdmaReport(error="pyverbs is not installed", pyverbs_available=False)
    assert choose_device("auto", no_pyverbs, sysfs_root=str(tmp_path / "none")).protocol == "tcp"
    (tmp_path / "mlx5_1").mkdir()
    (tmp_path / "mlx5_0").mkdir()
    choice = choose_device("auto", no_pyverbs, sysfs_root=str(tmp_path))
    assert (choice.device, choice.protocol, choice.candidates) == ("", "rdma", ("mlx5_0", "mlx5_1"))
    assert "P2PStore picks the device itself" in choice.reason
    # With pyverbs present its answer wins over the directory listing.
    assert choose_device("auto", RdmaReport(error="no RDMA devices"),
                         sysfs_root=str(tmp_path)).protocol == "tcp"
