"""RDMA NIC discovery (through pyverbs, optional) and the device choice for P2PStore."""

from __future__ import annotations

from fd_routing_replay.rdma.devices import (
    DeviceChoice,
    GidInfo,
    PortInfo,
    RdmaDevice,
    RdmaReport,
    choose_device,
    list_devices,
)

__all__ = ["DeviceChoice", "GidInfo", "PortInfo", "RdmaDevice", "RdmaReport",
           "choose_device", "list_devices"]
