"""Mooncake Store's return codes: their names, what an operator can do about them, and
which a retry cannot fix."""

from __future__ import annotations

__all__ = ["ERROR_CODES", "HINTS", "INVALID_PARAMS", "NO_AVAILABLE_HANDLE", "OBJECT_HAS_LEASE",
           "OBJECT_NOT_FOUND", "PERMANENT", "error_name"]

# Mooncake Store's ErrorCode (mooncake-store/include/types.h) as its Python client returns them.
OBJECT_NOT_FOUND, OBJECT_HAS_LEASE, NO_AVAILABLE_HANDLE, INVALID_PARAMS = -704, -706, -200, -600
ERROR_CODES: dict[int, str] = {
    -1: "INTERNAL_ERROR", -10: "BUFFER_OVERFLOW", -101: "SEGMENT_NOT_FOUND",
    -103: "CLIENT_NOT_FOUND", -200: "NO_AVAILABLE_HANDLE", -300: "INVALID_VERSION",
    -400: "INVALID_KEY", -500: "WRITE_FAIL", -600: "INVALID_PARAMS", -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE", -701: "INVALID_READ", -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY", -704: "OBJECT_NOT_FOUND", -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE", -707: "LEASE_EXPIRED", -708: "OBJECT_HAS_REPLICATION_TASK",
    -712: "REPLICA_IS_GONE", -714: "OBJECT_REPLICA_BUSY", -800: "TRANSFER_FAIL",
    -801: "CHECKSUM_MISMATCH", -900: "RPC_FAIL", -901: "RPC_TIMEOUT",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS", -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}
HINTS = {
    -200: "no mounted segment has room: the segments are full of pinned records or none is "
          "mounted (run mooncake_client, or give a long-lived process "
          "store.mooncake.global_segment_size > 0); delete records or add segments",
    -400: "Mooncake rejected the key",
    -601: "the master does not know this client (it restarted?); reopen the store",
    -706: "the object is leased by a reader (a get/exists in the last lease TTL)",
    -900: "the master does not answer (down or restarting?)",
    -901: "the master did not answer in time",
}
PERMANENT = frozenset({-1, -10, -300, -400, -601, -705})
"""Codes a retry cannot fix; every other failure (RPC, transfer, busy, full) is transient."""


def error_name(code: int) -> str:
    return ERROR_CODES.get(code, "unknown error")
