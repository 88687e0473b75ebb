"""verl's Megatron R3 path on a batch fill_routed_experts filled (run in its own process).

``python -m tests.trainers.verl_megatron_r3 SEED`` from the repository root; prints
``verl megatron r3 ok`` when every check passes.  It runs verl 0.9.1's own code from the
rollout's DataProto to the routers' choice: ``to_tensordict``, ``left_right_2_no_padding``,
``align_r3_router_replay_data``, ``build_r3_replay_mask``, ``set_router_replay_data`` (with
the forwarded model's routers) and the routing of Megatron-Core's ``TopKRouter`` as
``apply_router_replay_patch`` patches it.  It needs a process of its own: the patch changes
Megatron-Core's classes for the whole process, and verl picks its device when
``router_replay_utils`` is imported, so the CPU platform is registered first, through
verl's platform API (``set_platform``; verl 0.9.1 has no CPU platform of its own).
"""

from __future__ import annotations

import sys
import tempfile
import types
import warnings

import numpy as np

warnings.simplefilter("ignore")

import torch  # noqa: E402
from megatron.core import parallel_state as mpu  # noqa: E402
from verl.plugin.platform.platform_cuda import PlatformCUDA  # noqa: E402
from verl.plugin.platform.platform_manager import set_platform  # noqa: E402


class CPUPlatform(PlatformCUDA):
    """verl's CUDA platform with tensors kept on the CPU (no GPU here)."""

    @property
    def device_name(self) -> str:
        return "cpu"


set_platform(CPUPlatform())

from megatron.core.transformer.moe.router import TopKRouter  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402
from verl.utils.megatron.router_replay_patch import (  # noqa: E402
    RouterReplayAction,
    apply_router_replay_patch,
)
from verl.utils.megatron.router_replay_utils import (  # noqa: E402
    align_r3_router_replay_data,
    build_r3_replay_mask,
    set_router_replay_data,
)
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from fd_routing_replay.trainers.verl_batch import fill_routed_experts  # noqa: E402
from tests.trainers.verl_batches import MOE_LAYERS, NUM_LAYERS, E, K, rollout_batch  # noqa: E402


def model_routers(config: TransformerConfig) -> torch.nn.ModuleList:
    """One replay-enabled TopKRouter per MoE layer, numbered as Megatron numbers them."""
    groups = types.SimpleNamespace(tp=None, cp=None, tp_cp=None, tp_dp_cp=None)
    routers = torch.nn.ModuleList()
    for layer in MOE_LAYERS:
        router = TopKRouter(config, pg_collection=groups)
        router.layer_number = layer + 1                 # Megatron's layer numbers start at 1
        router.eval()
        routers.append(router)
    return routers


def check(seed: int, num_layers: int | None, engine: str | None) -> None:
    gen = np.random.default_rng(seed)
    data, reader, records, lengths = rollout_batch(gen)
    filled = fill_routed_experts(data, reader, num_layers=num_layers, engine=engine)
    config = TransformerConfig(num_layers=NUM_LAYERS, hidden_size=16, num_attention_heads=2,
                               num_moe_experts=E, moe_router_topk=K,
                               moe_layer_freq=[int(i in MOE_LAYERS) for i in range(NUM_LAYERS)],
                               moe_router_load_balancing_type="none",
                               use_cpu_initialization=True, enable_routing_replay=True)
    routers = model_routers(config)

    batch = left_right_2_no_padding(data.to_tensordict())          # verl's engine input
    routes = align_r3_router_replay_data(batch["routed_experts"], batch["input_ids"])
    replay_mask = build_r3_replay_mask(batch["input_ids"], batch["response_mask"])
    set_router_replay_data(routes, None, config, replay_mask=replay_mask, model=routers)

    offsets = np.cumsum([0] + [p + r for p, r in lengths])
    for row, (layer, router) in enumerate(zip(MOE_LAYERS, routers, strict=True)):
        logits = torch.from_numpy(gen.standard_normal((offsets[-1], 1, E)).astype(np.float32))
        native = torch.topk(logits.view(-1, E), K, dim=1).indices.numpy()
        router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        _, routing_map = router.routing(logits)
        chosen = [sorted(np.flatnonzero(m).tolist()) for m in routing_map.numpy()]
        for i, record in enumerate(records):
            tokens = lengths[i][0] + lengths[i][1]
            ids = record.ids[row]
            for t in range(tokens):
                got = chosen[offsets[i] + t]
                if t == tokens - 1:                    # last token: verl keeps native routing
                    assert got == sorted(native[offsets[i] + t].tolist()), (layer, i, t)
                elif (ids[t] != record.fill_value).all():
                    assert got == sorted(ids[t].tolist()), (layer, i, t, got, ids[t])
                elif engine == "megatron":             # unrouted: distinct placeholders
                    assert got == list(range(K)), (layer, i, t, got)
                else:                                  # unrouted: verl's zeros collapse on
                    assert got == [0], (layer, i, t, got)      # expert 0 (VeOmni's layout)
        assert filled.layers == (MOE_LAYERS if num_layers is None else tuple(range(num_layers)))


def main() -> None:
    seed = int(sys.argv[1])
    apply_router_replay_patch()
    torch.distributed.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/pg",
                                         world_size=1, rank=0)
    mpu.initialize_model_parallel()
    try:
        check(seed, None, None)                        # one slot per MoE layer: MoE ordinal
        check(seed + 2, None, "megatron")              # the same, laid out for Megatron
        check(seed + 1, NUM_LAYERS, "megatron")        # one slot per decoder layer: absolute
    finally:
        mpu.destroy_model_parallel()
        torch.distributed.destroy_process_group()
    print("verl megatron r3 ok")


if __name__ == "__main__":
    main()
