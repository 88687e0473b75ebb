"""verl without a fork: fill a ``DataProto``'s ``routed_experts`` from the store by rollout id.

verl 0.9.1 gets routes only from its own vLLM / SGLang rollout servers
(``rollout.enable_rollout_routing_replay``); nothing in it reads an external store.  With
FastDeploy as the rollout engine the routes are in our store, keyed by the rollout id the
request sent as the OpenAI ``user`` field.  Two pieces close the gap:

* :func:`verl_rollout_id` names an agent-loop run.  verl names requests ``uuid4().hex``,
  one per agent-loop run and kept across its turns (``det-{priority}`` under
  ``rollout.full_determinism``, which repeats across samples and is refused here), and
  sends no ``user`` field; the prompt's ``uid`` (one per dataset prompt, shared by its
  ``rollout.n`` samples) is in the agent loop's keyword arguments.  The rollout id
  ``{experiment}_{uid}:{request_id}:{turn}:{segment}`` is unique per sample and turn, and
  a boundary-safe prefix delete of ``{experiment}_{uid}`` drops a prompt's samples.
  The agent loop that calls FastDeploy sends it as ``user`` and puts the last turn's id in
  ``AgentLoopOutput.extra_fields["rollout_id"]``; verl's agent loop turns extra fields
  into ``non_tensor_batch`` columns, which travel with their rows through verl's
  ``union``, ``reorder`` and ``concat``.
* :func:`fill_routed_experts` reads that column, fetches the records (one
  ``reader.get_many``) and writes ``batch["routed_experts"]`` in verl's layout
  (:mod:`fd_routing_replay.trainers.verl`), checking each record against its sample.

This module imports neither verl nor torch: it reads ``data.batch`` and
``data.non_tensor_batch`` as verl's ``DataProto`` holds them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from fd_routing_replay.codec import RoutingRecord
from fd_routing_replay.keys import parse_rollout_id
from fd_routing_replay.trainers._common import host_array, routed_length
from fd_routing_replay.trainers.verl import VerlRoutedExperts, to_verl_routed_experts

__all__ = ["ROLLOUT_ID_KEY", "fill_routed_experts", "verl_rollout_id"]

ROLLOUT_ID_KEY = "rollout_id"
"""The ``non_tensor_batch`` column (``AgentLoopOutput.extra_fields`` key) of rollout ids."""

_DETERMINISTIC_REQUEST_ID = re.compile(r"det-[0-9]+", re.ASCII)
_REQUIRED = ("prompts", "responses", "attention_mask", "input_ids")


def verl_rollout_id(experiment: str, uid: str, request_id: str, *, turn: int = 0,
                    segment: int = 0) -> str:
    """The rollout id of turn ``turn`` of a verl agent-loop run:
    ``{experiment}_{uid}:{request_id}:{turn}:{segment}``.

    ``uid`` is the sample's ``non_tensor_batch["uid"]`` (the agent loop's ``kwargs["uid"]``),
    ``request_id`` the agent loop's own request id (``uuid4().hex``).  Send it as the
    OpenAI ``user`` field.  Refuses verl's ``full_determinism`` request ids
    (``det-{priority}``), which repeat, and anything the rollout-id grammar refuses."""
    for name, value in (("experiment", experiment), ("uid", uid), ("request_id", request_id)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"{name} must be a non-empty str, got {value!r}")
    if _DETERMINISTIC_REQUEST_ID.fullmatch(request_id):
        raise ValueError(
            f"request_id {request_id!r} is verl's full_determinism id (det-{{priority}}), "
            "which several samples share: their records would overwrite each other. Name "
            "the run with a unique id (uuid4().hex) instead")
    for name, value in (("turn", turn), ("segment", segment)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return parse_rollout_id(f"{experiment}_{uid}:{request_id}:{turn}:{segment}").text




def _batch_arrays(data: Any) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``input_ids``, the bool attention mask, and the padded prompt / response widths of a
    DataProto's batch; ValueError unless it is verl's left/right-padded layout."""
    batch = getattr(data, "batch", None)
    if batch is None:
        raise ValueError("data has no tensor batch (expected a verl DataProto)")
    missing = [key for key in _REQUIRED if key not in batch.keys()]
    if missing:
        raise ValueError(f"data.batch lacks {missing}: fill_routed_experts needs verl's "
                         f"rollout output ({', '.join(_REQUIRED)}); it has {sorted(batch.keys())}")
    prompt_width = int(batch["prompts"].shape[1])
    response_width = int(batch["responses"].shape[1])
    mask = host_array(batch["attention_mask"]).astype(bool)
    input_ids = host_array(batch["input_ids"])
    if mask.ndim != 2 or mask.shape[1] != prompt_width + response_width:
        raise ValueError(f"attention_mask has shape {mask.shape}, expected "
                         f"[batch, {prompt_width} + {response_width}] (prompts + responses)")
    return input_ids, mask, prompt_width, response_width


def _sample_lengths(mask: np.ndarray, prompt_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompt and response tokens of each sample; ValueError naming a sample whose mask is
    not a left-padded prompt followed by a right-padded response (where rows would land
    elsewhere than on its tokens)."""
    prompt, response = mask[:, :prompt_width], mask[:, prompt_width:]
    prompt_lengths, response_lengths = prompt.sum(axis=1), response.sum(axis=1)
    for i in range(len(mask)):
        p, r = int(prompt_lengths[i]), int(response_lengths[i])
        if prompt[i, prompt_width - p:].sum() != p or response[i, :r].sum() != r:
            raise ValueError(f"sample {i}: attention mask is not a left-padded prompt and a "
                             "right-padded response (verl's agent-loop layout)")
    return prompt_lengths, response_lengths


def _rollout_ids(data: Any, rollout_ids: Sequence[str] | None, id_key: str) -> list[str]:
    if rollout_ids is None:
        columns = getattr(data, "non_tensor_batch", None) or {}
        if id_key not in columns:
            raise ValueError(f"data.non_tensor_batch has no {id_key!r} column (it has "
                             f"{sorted(columns)}): set AgentLoopOutput.extra_fields[{id_key!r}] "
                             "in the agent loop, or pass rollout_ids")
        rollout_ids = columns[id_key]
    ids = [str(rid) if isinstance(rid, str) else rid for rid in rollout_ids]
    for i, rid in enumerate(ids):
        if not isinstance(rid, str):
            raise ValueError(f"sample {i}: rollout id must be a str, got {rid!r}")
    seen: dict[str, int] = {}
    for i, rid in enumerate(ids):
        if rid in seen:
            raise ValueError(f"samples {seen[rid]} and {i} share rollout id {rid!r}: one "
                             "record cannot route two samples (name each run uniquely)")
        seen[rid] = i
    return ids


def _fetch(reader: Any, ids: list[str], allow_missing: bool, timeout: float
           ) -> list[RoutingRecord | None]:
    found = dict(reader.get_many(ids))
    missing = [rid for rid in ids if found.get(rid) is None]
    if missing and timeout > 0:
        try:
            found.update(reader.wait_many(missing, timeout))
        except TimeoutError:
            if not allow_missing:
                raise
            for rid in missing:            # take what arrived; the rest stay unrouted
                found[rid] = reader.get(rid)
        missing = [rid for rid in ids if found.get(rid) is None]
    if missing and not allow_missing:
        shown = ", ".join(repr(rid) for rid in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise LookupError(f"{len(missing)} of {len(ids)} rollouts have no routing record: "
                          f"{shown}{more} (pass timeout= to wait for the writer, or "
                          "allow_missing=True to leave them unrouted)")
    return [found.get(rid) for rid in ids]


def _check_sample(i: int, record: RoutingRecord, tokens: np.ndarray, exact_length: bool) -> None:
    rows, expected = routed_length(record), len(tokens) - 1
    if exact_length and rows != expected:
        raise ValueError(
            f"sample {i}: record {record.rollout_id!r} has {rows} routed positions but the "
            f"sample has {len(tokens)} tokens (prompt + response), so {expected} are "
            "expected; a record of another sequence would misroute it. Pass "
            "exact_length=False to cut or leave unrouted as verl's agent loop does "
            "(truncated responses, trailing tool tokens)")
    if record.num_tokens <= len(tokens):   # a longer record's extra rows cannot be checked
        record.check_tokens(tokens)        # no-op without a tokens hash


def fill_routed_experts(data: Any, reader: Any, *, rollout_ids: Sequence[str] | None = None,
                        id_key: str = ROLLOUT_ID_KEY, num_layers: int | None = None,
                        engine: str | None = None, exact_length: bool = True,
                        allow_missing: bool = False, timeout: float = 0.0) -> VerlRoutedExperts:
    """Set ``data.batch["routed_experts"]`` of a verl ``DataProto`` (the output of the
    rollout, before ``compute_log_prob``) from the records of its samples.

    Sample ``i`` is rollout ``rollout_ids[i]``, by default ``data.non_tensor_batch[id_key]``.
    The records come from one ``reader.get_many`` (a :class:`~fd_routing_replay.reader.
    RoutingReader`); with ``timeout`` > 0 missing ones are waited for.  A rollout without a
    record raises ``LookupError`` naming it, unless ``allow_missing`` (then its sample is
    unrouted: 0, which verl's VeOmni engine routes natively).  Each record must cover
    exactly its sample's ``prompt + response - 1`` positions (``exact_length=False``
    cuts a longer one and leaves the rest of a shorter one unrouted, as verl's agent loop
    does) and, when it carries a tokens hash and is no longer than the sample, belong to
    the sample's tokens (``RecordError`` otherwise).  ``num_layers`` and ``engine`` shape the layer axis as in
    :func:`~fd_routing_replay.trainers.verl.to_verl_routed_experts`.  Returns the layout,
    whose ``routed_mask`` marks the positions with recorded routes."""
    input_ids, mask, prompt_width, response_width = _batch_arrays(data)
    prompt_lengths, _ = _sample_lengths(mask, prompt_width)
    ids = _rollout_ids(data, rollout_ids, id_key)
    if len(ids) != len(mask):
        raise ValueError(f"{len(ids)} rollout ids for a batch of {len(mask)} samples")
    records = _fetch(reader, ids, allow_missing, float(timeout))
    for i, record in enumerate(records):
        if record is not None:
            _check_sample(i, record, input_ids[i][mask[i]], exact_length)
    out = to_verl_routed_experts(records, prompt_lengths, max_prompt_length=prompt_width,
                                 max_response_length=response_width, num_layers=num_layers,
                                 engine=engine)
    data.batch["routed_experts"] = out.to_torch()
    return out
