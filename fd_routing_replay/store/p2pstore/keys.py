"""How store keys become P2PStore keys, and the Redis keys P2PStore itself keeps.

P2PStore silently skips any key containing ``88888888`` (and still returns True), so the
tree layout stores ``{ns}/{key}`` with ``%`` -> ``%25`` and ``8`` -> ``%38``: no stored key
contains two ``8`` in a row.
"""

from __future__ import annotations

import re

__all__ = ["FILE_INDEX", "FILE_PREFIX", "PROVIDER_PREFIX", "decode_component",
           "encode_component", "glob_escape", "stored_key"]

FILE_PREFIX = "p2p:files:"          # P2PStore's metadata record of one key
FILE_INDEX = "p2p:files:index"      # P2PStore's set of every key (we only SSCAN our slice)
PROVIDER_PREFIX = "p2p:providers:"  # P2PStore's registration of one transport address
_ESCAPES = re.compile(r"%(25|38)")


def encode_component(text: str) -> str:
    """Escape ``%`` and ``8`` so the result never contains ``88``: P2PStore drops any key
    holding ``88888888``.  Injective; :func:`decode_component` inverts it."""
    return text.replace("%", "%25").replace("8", "%38")


def decode_component(text: str) -> str:
    """Invert :func:`encode_component` (one left-to-right pass)."""
    return _ESCAPES.sub(lambda m: "%" if m.group(1) == "25" else "8", text)


def stored_key(namespace: str, key: str) -> str:
    """The P2PStore key of a store key: ``{ns}/{key}``, both escaped."""
    return f"{encode_component(namespace)}/{encode_component(key)}"


def glob_escape(text: str) -> str:
    """``text`` as a literal in a Redis ``MATCH`` glob."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
