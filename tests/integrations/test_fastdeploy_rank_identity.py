"""Whose journal a writer takes: workers by their DP rank, 2.6 engines by the DP rank they serve.

An engine process never gets ``data_parallel_rank`` (only workers do,
worker_process.py:1191 in FastDeploy 2.6); FastDeploy's ExpertService sets
``local_data_parallel_id`` per DP rank of a node.  The multi-process contract test
(tests/fastdeploy_contract/test_parallel.py) runs two DP engines against one store.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fd_routing_replay.integrations.fastdeploy.setup import engine_rank_identity, rank_identity


def engine_config(*, dp, local_id, nnode=1, node_rank=0, tp=1, devices="0,1,2,3,4,5,6,7"):
    parallel = SimpleNamespace(data_parallel_size=dp, local_data_parallel_id=local_id, data_parallel_rank=0,
                               tensor_parallel_size=tp, tensor_parallel_rank=0, device_ids=devices)
    ids = devices.split(",")[local_id * tp:(local_id + 1) * tp]       # config.py:2316-2320
    return SimpleNamespace(parallel_config=parallel, nnode=nnode, node_rank=node_rank, local_device_ids=ids)


def test_each_dp_engine_of_a_node_gets_its_own_identity():
    identities = [engine_rank_identity(engine_config(dp=4, local_id=i, tp=2)) for i in range(4)]
    assert [i.dp_rank for i in identities] == [0, 1, 2, 3]
    assert [i.device_id for i in identities] == [0, 2, 4, 6]
    assert {i.tp_rank for i in identities} == {0}
    # the old derivation (the worker's) gave every engine DP rank 0 and device 0: one journal
    assert {rank_identity(engine_config(dp=4, local_id=i, tp=2)).dp_rank for i in range(4)} == {0}


@pytest.mark.parametrize("node_rank", [0, 1, 2])
def test_engines_on_other_nodes_continue_the_numbering(node_rank):
    got = [engine_rank_identity(engine_config(dp=6, local_id=i, nnode=3, node_rank=node_rank)).dp_rank
           for i in range(2)]
    assert got == [2 * node_rank, 2 * node_rank + 1]


def test_a_single_engine_is_dp_rank_zero():
    config = engine_config(dp=1, local_id=0)
    config.local_device_ids = None
    identity = engine_rank_identity(config)
    assert (identity.dp_rank, identity.tp_rank, identity.device_id) == (0, 0, 0)
