"""Optional provenance of a record: what a trainer can check before replaying it.

Four optional rr-v1 header fields (docs/record-format.md#provenance):

* ``nd`` — the model's total decoder-layer count (dense, MoE; MTP/draft layers not
  counted), so a trainer can lay rows out over all layers (SGLang's ``[T, L_all, K]``)
  without guessing from the layer map;
* ``wv`` — the weights version the rollout was generated with (a string the RL loop sets,
  e.g. the training step), so stale routing is caught;
* ``th`` — :func:`tokens_digest` of the token ids of the positions the rows cover, so a
  trainer verifies that routes and tokens belong together (:meth:`Provenance.check_tokens`);
* ``sg`` — segment start offsets (token positions) for a rollout made of several segments
  (e.g. agent turns with tool output between them), first 0, strictly increasing.

Records without them read as before (every field None).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fd_routing_replay.codec.checksum import xxh3_64
from fd_routing_replay.errors import RecordError

__all__ = ["MAX_WEIGHTS_VERSION", "Provenance", "tokens_digest"]

MAX_WEIGHTS_VERSION = 256
"""Longest weights version (characters)."""
_MAX_LAYERS = 2**16
_MAX_SEGMENTS = 2**16


def tokens_digest(token_ids: Any) -> int:
    """xxh3-64 of ``token_ids`` as little-endian int64, the value of the ``th`` field.

    Hash exactly the tokens at the positions the rows cover: with the ``forwarded``
    convention, the first ``num_tokens`` ids of prompt + response.
    """
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
        raise RecordError(f"token ids must be a 1-D integer sequence, got shape {ids.shape} "
                          f"of {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > np.iinfo(np.int64).max):
        raise RecordError("token ids must be non-negative and fit int64")
    return xxh3_64(np.ascontiguousarray(ids, dtype="<i8"))


@dataclass(frozen=True)
class Provenance:
    """The optional provenance fields of one record (None = not recorded)."""

    num_decoder_layers: int | None = None
    weights_version: str | None = None
    tokens_hash: int | None = None
    segments: tuple[int, ...] | None = None

    def problem(self, num_tokens: int, layer_map: Sequence[int]) -> str | None:
        """What is wrong with these fields for a record of ``num_tokens`` rows and
        ``layer_map``, or None."""
        nd = self.num_decoder_layers
        if nd is not None:
            if not _is_int(nd) or not 1 <= nd <= _MAX_LAYERS:
                return f"num_decoder_layers must be an int in [1, {_MAX_LAYERS}], got {nd!r}"
            if layer_map and max(layer_map) >= nd:
                return (f"num_decoder_layers {nd} is not above the layer map's last layer "
                        f"{max(layer_map)}")
        wv = self.weights_version
        if wv is not None and (not isinstance(wv, str) or not wv or len(wv) > MAX_WEIGHTS_VERSION):
            return f"weights_version must be a str of 1..{MAX_WEIGHTS_VERSION} characters, got {wv!r}"
        th = self.tokens_hash
        if th is not None and (not _is_int(th) or not 0 <= th < 2**64):
            return f"tokens_hash must be an int in [0, 2**64), got {th!r}"
        sg = self.segments
        if sg is not None:
            if not isinstance(sg, (tuple, list)) or not all(_is_int(s) for s in sg):
                return f"segments must be a sequence of ints, got {sg!r}"
            if len(sg) > _MAX_SEGMENTS:
                return f"segments has {len(sg)} entries, more than {_MAX_SEGMENTS}"
            if sg and (sg[0] != 0 or any(b <= a for a, b in zip(sg, sg[1:], strict=False))
                       or sg[-1] >= max(num_tokens, 1)):
                return (f"segments must start at 0, increase strictly and stay below the "
                        f"{num_tokens} tokens, got {list(sg)}")
        return None

    def to_header(self) -> dict[str, Any]:
        """The header entries for the fields that are set."""
        out: dict[str, Any] = {}
        for key, value in (("nd", self.num_decoder_layers), ("wv", self.weights_version),
                           ("th", self.tokens_hash)):
            if value is not None:
                out[key] = value
        if self.segments is not None:
            out["sg"] = list(self.segments)
        return out

    @classmethod
    def from_header(cls, header: dict[str, Any], num_tokens: int,
                    layer_map: Sequence[int]) -> Provenance:
        """The fields of a decoded header; a malformed one raises RecordError naming it."""
        segments = header.get("sg")
        provenance = cls(header.get("nd"), header.get("wv"), header.get("th"),
                         tuple(segments) if isinstance(segments, list) else segments)
        problem = provenance.problem(num_tokens, layer_map)
        if problem:
            raise RecordError(f"bad rr-v1 provenance field: {problem}")
        return provenance

    def check_tokens(self, token_ids: Any, num_tokens: int) -> None:
        """Raise RecordError unless the first ``num_tokens`` of ``token_ids`` (prompt +
        response) are the tokens the record's rows belong to; a no-op without a hash."""
        if self.tokens_hash is None:
            return
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.shape[0] < num_tokens:
            raise RecordError(f"the record covers {num_tokens} positions but "
                              f"{ids.shape[0] if ids.ndim == 1 else ids.shape} token ids were given")
        if tokens_digest(ids[:num_tokens]) != self.tokens_hash:
            raise RecordError("the routes do not belong to these tokens (tokens hash mismatch): "
                              "the record was written for another prompt or response")


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)
