"""RDMA NIC discovery through pyverbs, and the device choice for ``device: auto``.

P2PStore moves records over RDMA when the node has a usable NIC and over its TCP
transport otherwise.  This module answers "which NICs are there, are their ports up,
which link layer and GIDs do they carry, and which one should P2PStore use?" without
ever raising on a machine that has no RDMA: no pyverbs, no devices, or a
``PyverbsRDMAError`` from ``ibv_get_device_list`` all give an :class:`RdmaReport` that
says "TCP only" and why.

pyverbs (extra ``verbs``) is imported lazily; the parsing helpers below work on any
object with pyverbs' attribute names, so they are tested on data shaped like its
results.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["DeviceChoice", "GidInfo", "PortInfo", "RdmaDevice", "RdmaReport",
           "choose_device", "gid_from_entry", "list_devices", "port_from_attr",
           "port_rate_gbps", "sysfs_device_names"]

SYSFS_ROOT = "/sys/class/infiniband"

# ibv_port_state
PORT_STATES = {0: "NOP", 1: "DOWN", 2: "INIT", 3: "ARMED", 4: "ACTIVE", 5: "ACTIVE_DEFER"}
PORT_ACTIVE = 4
# ibv_port_attr.link_layer
LINK_LAYERS = {0: "unspecified", 1: "InfiniBand", 2: "Ethernet"}
# ibv_gid_entry.gid_type
GID_TYPES = {0: "IB", 1: "RoCEv1", 2: "RoCEv2"}
# ibv_port_attr.active_speed (and active_speed_ex) -> Gb/s per lane
_LANE_GBPS = {1: 2.5, 2: 5.0, 4: 10.0, 8: 10.3125, 16: 14.0625, 32: 25.78125, 64: 53.125,
              128: 106.25, 256: 212.5}
# ibv_port_attr.active_width -> lanes
_LANES = {1: 1, 2: 4, 4: 8, 8: 12, 16: 2}
# ibv_mtu -> bytes
_MTU_BYTES = {1: 256, 2: 512, 3: 1024, 4: 2048, 5: 4096}
_ZERO_GID = "0000:0000:0000:0000:0000:0000:0000:0000"
PYVERBS_HINT = "pip install 'fd-routing-replay[verbs]'"


@dataclass(frozen=True)
class GidInfo:
    """One GID table entry of a port."""

    index: int
    gid: str
    type: str  # "IB", "RoCEv1", "RoCEv2" or "unknown(N)"
    ifindex: int | None = None


@dataclass(frozen=True)
class PortInfo:
    """One physical port: state, link layer, speed and GIDs."""

    number: int
    state: str
    state_code: int
    link_layer: str
    active_mtu: int
    rate_gbps: float | None
    lid: int = 0
    gids: tuple[GidInfo, ...] = ()

    @property
    def active(self) -> bool:
        return self.state_code == PORT_ACTIVE

    @property
    def usable(self) -> bool:
        """Up, and reachable: InfiniBand, or Ethernet (RoCE) with at least one GID."""
        if not self.active:
            return False
        if self.link_layer == "Ethernet":
            return bool(self.gids)
        return True

    def describe(self) -> str:
        rate = f"{self.rate_gbps:g} Gb/s" if self.rate_gbps else "rate unknown"
        roce = sorted({g.type for g in self.gids})
        gids = f"{len(self.gids)} GID(s) {'/'.join(roce)}" if self.gids else "no GIDs"
        return f"port {self.number}: {self.state}, {self.link_layer}, {rate}, {gids}"


@dataclass(frozen=True)
class RdmaDevice:
    """One RDMA device (``ibv_get_device_list`` entry) and its ports."""

    name: str
    node_guid: str = ""
    fw_version: str = ""
    vendor_id: int = 0
    vendor_part_id: int = 0
    ports: tuple[PortInfo, ...] = ()
    error: str | None = None  # set when the device could not be opened or queried

    @property
    def usable_ports(self) -> list[PortInfo]:
        return [port for port in self.ports if port.usable]


@dataclass(frozen=True)
class RdmaReport:
    """What the node offers for RDMA; ``tcp_only`` when nothing is usable, with the reason."""

    devices: tuple[RdmaDevice, ...] = ()
    error: str | None = None  # why there is no device list at all
    pyverbs_available: bool = True

    @property
    def usable(self) -> list[tuple[RdmaDevice, PortInfo]]:
        return [(device, port) for device in self.devices for port in device.usable_ports]

    @property
    def tcp_only(self) -> bool:
        return not self.usable

    @property
    def reason(self) -> str:
        """One sentence: why RDMA is or is not available."""
        if self.error:
            return self.error
        if not self.devices:
            return "no RDMA devices found"
        if self.tcp_only:
            states = "; ".join(
                f"{d.name}: {d.error or ', '.join(p.describe() for p in d.ports) or 'no ports'}"
                for d in self.devices)
            return f"no RDMA device has a usable (ACTIVE) port ({states})"
        names = sorted({device.name for device, _ in self.usable})
        return f"{len(names)} RDMA device(s) with an active port: {', '.join(names)}"

    def summary(self) -> str:
        """A readable multi-line report, starting with the verdict."""
        head = ("TCP only: " + self.reason) if self.tcp_only else ("RDMA available: " + self.reason)
        lines = [head]
        for device in self.devices:
            detail = f"fw {device.fw_version}" if device.fw_version else ""
            lines.append(f"  {device.name} {detail}".rstrip())
            if device.error:
                lines.append(f"    error: {device.error}")
            for port in device.ports:
                lines.append(f"    {port.describe()}")
                for gid in port.gids:
                    lines.append(f"      gid[{gid.index}] {gid.gid} {gid.type}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"tcp_only": self.tcp_only, "reason": self.reason,
                "pyverbs_available": self.pyverbs_available,
                "devices": [asdict(device) for device in self.devices]}


@dataclass(frozen=True)
class DeviceChoice:
    """The outcome of :func:`choose_device`.

    ``device`` is the NIC name(s) to hand P2PStore (``None`` = none usable); ``protocol``
    is ``"rdma"`` or ``"tcp"``; ``ok`` is False when an explicitly configured device
    cannot be used (a misconfiguration, as opposed to a node without RDMA).
    """

    device: str | None
    protocol: str
    reason: str
    ok: bool = True
    candidates: tuple[str, ...] = field(default=())


# -- parsing pyverbs objects ------------------------------------------------------------

def port_rate_gbps(active_speed: int, active_width: int, active_speed_ex: int = 0) -> float | None:
    """Link rate in Gb/s from ``ibv_port_attr`` speed and width codes (None if unknown)."""
    speed = active_speed_ex or active_speed
    lane = _LANE_GBPS.get(speed)
    lanes = _LANES.get(active_width)
    if lane is None or lanes is None:
        return None
    # Report the marketing rate (e.g. 4x EDR = 100, 4x NDR = 400) rather than the line rate.
    nominal = {10.3125: 10.0, 14.0625: 14.0, 25.78125: 25.0, 53.125: 50.0, 106.25: 100.0,
               212.5: 200.0}.get(lane, lane)
    return nominal * lanes


def _gid_text(entry: Any) -> str:
    text = getattr(entry, "gid_str", None)
    if callable(text):
        text = text()
    if isinstance(text, str):
        return text
    # pyverbs GID objects (ctx.query_gid) expose .gid
    return str(getattr(entry, "gid", entry))


def gid_from_entry(entry: Any, index: int | None = None) -> GidInfo | None:
    """A :class:`GidInfo` from a pyverbs ``GIDEntry`` (or ``GID``); None for an empty GID."""
    text = _gid_text(entry)
    if not text or text == _ZERO_GID:
        return None
    gid_type = getattr(entry, "gid_type", None)
    type_name = GID_TYPES.get(gid_type, f"unknown({gid_type})") if gid_type is not None else "unknown"
    ifindex = getattr(entry, "ndev_ifindex", None)
    position = getattr(entry, "gid_index", index)
    return GidInfo(index=int(position if position is not None else -1), gid=text,
                   type=type_name, ifindex=int(ifindex) if ifindex else None)


def port_from_attr(number: int, attr: Any, gids: Iterable[GidInfo] = ()) -> PortInfo:
    """A :class:`PortInfo` from a pyverbs ``PortAttr`` (``ctx.query_port(n)``)."""
    state_code = int(getattr(attr, "state", 0))
    link_code = int(getattr(attr, "link_layer", 0))
    return PortInfo(
        number=number,
        state=PORT_STATES.get(state_code, f"UNKNOWN({state_code})"),
        state_code=state_code,
        link_layer=LINK_LAYERS.get(link_code, f"unknown({link_code})"),
        active_mtu=_MTU_BYTES.get(int(getattr(attr, "active_mtu", 0)), 0),
        rate_gbps=port_rate_gbps(int(getattr(attr, "active_speed", 0)),
                                 int(getattr(attr, "active_width", 0)),
                                 int(getattr(attr, "active_speed_ex", 0) or 0)),
        lid=int(getattr(attr, "lid", 0)),
        gids=tuple(sorted(gids, key=lambda g: g.index)),
    )


def _name(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _read_gids(context: Any, port_number: int, table_len: int, max_gids: int,
               table: Sequence[Any] | None) -> list[GidInfo]:
    if table is not None:
        found = (gid_from_entry(e) for e in table if int(getattr(e, "port_num", 0)) == port_number)
        return [g for g in found if g is not None][:max_gids]
    gids = []
    for index in range(min(table_len, max_gids)):
        try:
            gid = gid_from_entry(context.query_gid(port_number, index), index)
        except Exception:  # noqa: BLE001 - a hole in the table is not an error
            continue
        if gid is not None:
            gids.append(gid)
    return gids


def _query_device(device_module: Any, name: str, max_gids: int) -> RdmaDevice:
    try:
        context = device_module.Context(name=name)
    except Exception as exc:  # noqa: BLE001 - reported per device
        return RdmaDevice(name=name, error=f"cannot open: {exc}")
    try:
        attr = context.query_device()
        try:
            table = context.query_gid_table(max_gids * 8)
        except Exception:  # noqa: BLE001 - old kernels: fall back to query_gid
            table = None
        ports = []
        for number in range(1, int(attr.phys_port_cnt) + 1):
            port_attr = context.query_port(number)
            gids = _read_gids(context, number, int(getattr(port_attr, "gid_tbl_len", 0)),
                              max_gids, table)
            ports.append(port_from_attr(number, port_attr, gids))
        guid = getattr(attr, "node_guid", 0)
        return RdmaDevice(
            name=name,
            node_guid=device_module.guid_to_hex(guid) if hasattr(device_module, "guid_to_hex")
            else f"{guid:x}",
            fw_version=str(getattr(attr, "fw_version", "")),
            vendor_id=int(getattr(attr, "vendor_id", 0)),
            vendor_part_id=int(getattr(attr, "vendor_part_id", 0)),
            ports=tuple(ports))
    except Exception as exc:  # noqa: BLE001 - reported per device
        return RdmaDevice(name=name, error=f"query failed: {exc}")
    finally:
        try:
            context.close()
        except Exception:  # noqa: BLE001
            pass


def list_devices(*, max_gids: int = 32) -> RdmaReport:
    """Every RDMA device, its ports and GIDs; never raises for a node without RDMA."""
    try:
        import pyverbs.device as device_module
    except ImportError as exc:
        return RdmaReport(error=f"pyverbs is not installed ({exc}); {PYVERBS_HINT}",
                          pyverbs_available=False)
    except OSError as exc:  # a wheel that cannot load libibverbs
        return RdmaReport(error=f"pyverbs cannot load libibverbs: {exc}", pyverbs_available=False)
    try:
        found = device_module.get_device_list()
    except Exception as exc:  # noqa: BLE001 - PyverbsRDMAError on a node without RDMA
        return RdmaReport(error=f"no RDMA devices (ibv_get_device_list failed: "
                                f"{type(exc).__name__}: {exc})")
    if not found:
        return RdmaReport(error="no RDMA devices found (ibv_get_device_list is empty)")
    devices = tuple(_query_device(device_module, _name(d.name), max_gids) for d in found)
    return RdmaReport(devices=devices)


def sysfs_device_names(root: str = SYSFS_ROOT) -> list[str]:
    """RDMA device names the kernel lists under ``root`` (works without pyverbs)."""
    try:
        return sorted(os.listdir(root))
    except OSError:
        return []


# -- choice --------------------------------------------------------------------------------

def _rank(pair: tuple[RdmaDevice, PortInfo]) -> tuple:
    device, port = pair
    has_roce_v2 = any(g.type == "RoCEv2" for g in port.gids)
    preferred_layer = port.link_layer == "InfiniBand" or has_roce_v2
    return (-(port.rate_gbps or 0.0), not preferred_layer, device.name, port.number)


def choose_device(config_device: str = "auto", report: RdmaReport | None = None, *,
                  sysfs_root: str = SYSFS_ROOT) -> DeviceChoice:
    """The NIC for P2PStore: ``"auto"`` picks the fastest usable port, names are checked.

    ``report`` defaults to :func:`list_devices`.  A node without RDMA gives
    ``protocol="tcp"`` with the reason; an explicitly named device that is missing or
    down gives ``ok=False`` naming the devices that are usable.  Without pyverbs, ``auto``
    on a node whose kernel lists RDMA devices (``sysfs_root``) gives ``device=""``:
    P2PStore then picks one itself from its topology scan.
    """
    report = report if report is not None else list_devices()
    requested = [name.strip() for name in (config_device or "auto").split(",") if name.strip()]
    usable = sorted(report.usable, key=_rank)
    candidates = tuple(dict.fromkeys(device.name for device, _ in usable))
    if not requested or requested == ["auto"]:
        kernel_devices = [] if report.pyverbs_available else sysfs_device_names(sysfs_root)
        if kernel_devices:
            return DeviceChoice("", "rdma",
                                f"{report.reason}; the kernel lists {', '.join(kernel_devices)} "
                                f"under {sysfs_root}, so P2PStore picks the device itself",
                                ok=True, candidates=tuple(kernel_devices))
        if not usable:
            return DeviceChoice(None, "tcp", f"TCP only: {report.reason}", ok=True)
        device, port = usable[0]
        rate = f"{port.rate_gbps:g} Gb/s" if port.rate_gbps else "rate unknown"
        return DeviceChoice(device.name, "rdma",
                            f"auto: {device.name} port {port.number} ({port.link_layer}, {rate})",
                            ok=True, candidates=candidates)
    if not report.pyverbs_available:
        return DeviceChoice(",".join(requested), "rdma",
                            f"configured device(s) {','.join(requested)} not verified: "
                            f"{report.reason}", ok=True)
    by_name = {device.name: device for device in report.devices}
    problems = []
    for name in requested:
        device = by_name.get(name)
        if device is None:
            problems.append(f"{name} not found")
        elif not device.usable_ports:
            states = device.error or "; ".join(p.describe() for p in device.ports) or "no ports"
            problems.append(f"{name} has no usable ACTIVE port ({states})")
    if problems:
        available = ", ".join(candidates) or "none"
        if report.tcp_only:
            return DeviceChoice(None, "tcp", f"TCP only: {'; '.join(problems)}; {report.reason}",
                                ok=False)
        return DeviceChoice(None, "tcp", f"{'; '.join(problems)}; usable devices: {available}",
                            ok=False, candidates=candidates)
    return DeviceChoice(",".join(requested), "rdma",
                        f"configured device(s) {','.join(requested)} are up", ok=True,
                        candidates=candidates)
