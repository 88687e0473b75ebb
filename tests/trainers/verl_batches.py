"""A verl rollout batch and its records in a store, for the tests that run verl's own code.

The batch is what verl 0.9.1's agent loop hands the trainer (``_postprocess`` of
``verl/experimental/agent_loop/agent_loop.py``): ``prompts`` left-padded, ``responses``
right-padded, their concatenation as ``input_ids`` / ``attention_mask``, a
``response_mask`` with tool tokens 0, ``position_ids`` from verl's own
``compute_position_id_with_mask``, and the rollout ids as a ``non_tensor_batch`` column.
Each record routes its sample's forwarded tokens (prompt + response - 1) and carries the
hash of those tokens.
"""

from __future__ import annotations

import numpy as np
import torch
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask

from fd_routing_replay.codec import RoutingRecord, encode_record
from fd_routing_replay.codec.record import Provenance, tokens_digest
from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store
from tests.trainers.records import random_ids

E, K = 16, 2
NUM_LAYERS = 5
MOE_LAYERS = (1, 2, 4)            # decoder layers 0 and 3 are dense
PROMPT_WIDTH, RESPONSE_WIDTH = 10, 8
FILL = 255


def sample_record(gen: np.random.Generator, rollout_id: str, tokens: np.ndarray,
                  unrouted: tuple[int, ...] = ()) -> RoutingRecord:
    """A record of ``tokens`` (prompt + response): ``len - 1`` forwarded positions over
    MOE_LAYERS, ``unrouted`` positions holding the fill value, with the tokens hash."""
    rows = len(tokens) - 1
    ids = random_ids(gen, len(MOE_LAYERS), rows, K, E)
    for position in unrouted:
        ids[:, position] = FILL
    return RoutingRecord(rollout_id, np.ascontiguousarray(ids), E, FILL, {"num_tokens": rows},
                         layers=MOE_LAYERS,
                         provenance=Provenance(tokens_hash=tokens_digest(tokens[:rows])))


def rollout_batch(gen: np.random.Generator, size: int = 5, *, prefix: str = "grpo_u",
                  store_records: bool = True):
    """``(data, reader, records, lengths)``: a verl DataProto of ``size`` samples, a reader
    over a memory store holding their records (sample 1 with an unrouted position), the
    records, and each sample's (prompt, response) token counts."""
    prompts = np.zeros((size, PROMPT_WIDTH), dtype=np.int64)
    responses = np.zeros((size, RESPONSE_WIDTH), dtype=np.int64)
    prompt_mask = np.zeros_like(prompts)
    response_attention = np.zeros_like(responses)
    response_mask = np.zeros_like(responses)
    store = open_store("memory://", "verl_test")
    records, lengths, ids = [], [], []
    for i in range(size):
        p = int(gen.integers(1, PROMPT_WIDTH + 1))
        r = int(gen.integers(2, RESPONSE_WIDTH + 1))
        tokens = gen.integers(1, 1000, size=p + r)
        prompts[i, PROMPT_WIDTH - p:] = tokens[:p]
        prompt_mask[i, PROMPT_WIDTH - p:] = 1
        responses[i, :r] = tokens[p:]
        response_attention[i, :r] = 1
        response_mask[i, :r] = 1
        response_mask[i, r // 2:r // 2 + min(2, r - 1)] = 0          # tool tokens
        rollout_id = f"{prefix}{i}:{gen.integers(1 << 40):x}:0:0"
        record = sample_record(gen, rollout_id, tokens,
                               unrouted=(int(gen.integers(p + r - 1)),) if i == 1 else ())
        if store_records:
            store.put(rollout_id, encode_record(record))
        records.append(record)
        lengths.append((p, r))
        ids.append(rollout_id)
    attention_mask = torch.from_numpy(np.concatenate([prompt_mask, response_attention], axis=1))
    data = DataProto.from_dict(
        tensors={
            "prompts": torch.from_numpy(prompts),
            "responses": torch.from_numpy(responses),
            "input_ids": torch.from_numpy(np.concatenate([prompts, responses], axis=1)),
            "attention_mask": attention_mask,
            "response_mask": torch.from_numpy(response_mask),
            "position_ids": compute_position_id_with_mask(attention_mask),
        },
        non_tensors={"rollout_id": np.array(ids, dtype=object),
                     "uid": np.array([f"uid{i}" for i in range(size)], dtype=object)},
    )
    return data, RoutingReader(store), records, lengths
