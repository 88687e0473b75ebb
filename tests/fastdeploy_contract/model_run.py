"""The model matrix's worker: FastDeploy's own model classes, tiny, on the CPU, with the plugin.

Run as ``model_run.py SPEC.json`` by test_models.py (a process of its own: FastDeploy's CUDA
code paths need the CUDA platform presented before FastDeploy is imported, which the rest
of the contract tier must not see).  For each model of the spec: its ``config.json``, a
real ``FDConfig``, the model built by FastDeploy's ``ModelRegistry`` class, seeded random
weights, our manager installed by ``GpuWorker.initialize_cache`` with the model loaded,
then one request -- a prefill (in chunks when the spec says so) and decode steps -- through
the model's own ``forward`` and FastDeploy's step code (``drive.run``), the record read
back.  What the model computed is taken from the MoE selection kernels' outputs (the CPU
stand-ins of ``tests/fdcpu`` and ``cpu_kernels``), never from the hook.  Results land in
the spec's ``out`` directory: ``<name>.json`` (status, layer map, dtype, error) and
``<name>.npz`` (the record's ids and the computed top-k).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1]))
from tests.fdcpu import install  # noqa: E402

install()                                   # FastDeploy's compiled ops stood in, CUDA presented
if os.environ.get("FD_SOURCE_DIR"):
    sys.path.insert(0, os.environ["FD_SOURCE_DIR"])
if "FD_LOG_DIR" not in os.environ:          # test_models.py sets it inside its tmp dir
    os.environ["FD_LOG_DIR"] = tempfile.mkdtemp(prefix="fd-matrix-log-")

import cpu_kernels  # noqa: E402
import numpy as np  # noqa: E402
import paddle  # noqa: E402


class Patch:
    """``monkeypatch.setattr`` for drive.run outside pytest (the patches stay: one process)."""

    @staticmethod
    def setattr(target, name, value, raising=True):
        setattr(target, name, value)


class Selections:
    """The top-k each MoE selection kernel returned, in call order (the model's own routing)."""

    def __init__(self) -> None:
        self.calls: list[np.ndarray] = []

    def wrap(self, module, name, output_index):
        original = getattr(module, name)

        def recorded(*args, **kwargs):
            out = original(*args, **kwargs)
            self.calls.append(np.asarray(out[output_index].numpy()).astype(np.int64))
            return out
        recorded.fdrr_original = original
        setattr(module, name, recorded)


def fd_config_for(spec_model: dict, work: Path):
    from fastdeploy import config as C

    model_dir = work / "model"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(spec_model["config"]))
    # the worker's own arguments beside config.json (ERNIE-4.5-VL: --image_patch_id from the
    # tokenizer, worker_process.py / common_engine.py)
    mc = C.ModelConfig({"model": str(model_dir), "max_model_len": 256, **spec_model.get("model_args", {})})
    rr = C.RoutingReplayConfig({"enable_routing_replay": True, "local_store_dir": str(work / "store")})
    cc = C.CacheConfig({"block_size": 16, "model_cfg": mc})
    fd_config = C.FDConfig(
        model_config=mc, cache_config=cc,
        parallel_config=C.ParallelConfig({"tensor_parallel_size": 1, "engine_worker_queue_port": str(spec_model["port"])}),
        scheduler_config=C.SchedulerConfig({"max_num_seqs": 8, "max_num_batched_tokens": 256}),
        load_config=C.LoadConfig({"load_choices": "default_v1"}), graph_opt_config=C.GraphOptimizationConfig({}),
        eplb_config=C.EPLBConfig({}), routing_replay_config=rr, device_config=C.DeviceConfig({}),
        speculative_config=C.SpeculativeConfig({}))
    fd_config.parallel_config.tp_group = None
    return fd_config


def seeded_weights(model, rng) -> None:
    """Every float weight drawn N(0, 1/fan_in) (norm weights 1, biases small), so the tiny
    model's activations stay O(1) and its routers spread tokens over the experts."""
    for name, param in model.named_parameters():
        if param.dtype not in (paddle.float32, paddle.float16, paddle.bfloat16):
            continue
        shape = list(param.shape)
        if "norm" in name and len(shape) == 1:
            values = 1.0 + 0.1 * rng.standard_normal(shape)
        elif len(shape) == 1:
            values = 0.1 * rng.standard_normal(shape)
        else:
            fan_in = shape[-2] if len(shape) >= 2 else shape[0]
            values = rng.standard_normal(shape) / np.sqrt(max(fan_in, 1))
        param.set_value(paddle.to_tensor(values.astype(np.float32)).astype(param.dtype))


def vl_rows(calls: list, image: np.ndarray, text_experts: int) -> np.ndarray:
    """ERNIE-4.5-VL: the text MoE's and the image MoE's selections of each layer (in that
    order, ernie4_5_vl_moe.py:283-284) in token order, the image experts after the text
    experts; ``image``: which of the step's tokens are image tokens (ids >= im_patch_id,
    :508)."""
    if len(calls) % 2:
        raise AssertionError(f"{len(calls)} selections: not a text and an image MoE per layer")
    layers = []
    for text, image_ids in zip(calls[0::2], calls[1::2], strict=True):
        rows = np.empty((len(image), text.shape[1]), np.int64)
        rows[~image] = text[: int((~image).sum())]
        rows[image] = image_ids + text_experts
        layers.append(rows)
    return np.stack(layers)


def build_draft(fd_config, main_model, rng):
    """The MTP draft model as FastDeploy's proposer builds it: its own config from the main
    one by ``MTPProposer._update_mtp_config`` (FastDeploy's method, spec_decode/mtp.py:150-168,
    run on a copy), then the registry's class (``Ernie4_5_MTPForCausalLM``)."""
    import copy

    from fastdeploy.model_executor.models.model_base import ModelRegistry
    from fastdeploy.spec_decode.mtp import MTPProposer

    draft_config = copy.copy(fd_config)
    draft_config.model_config = copy.deepcopy(fd_config.model_config)
    draft_config.speculative_config = copy.deepcopy(fd_config.speculative_config)
    proposer = SimpleNamespace(model_config=draft_config.model_config, speculative_config=draft_config.speculative_config,
                               num_main_model_layers=fd_config.model_config.num_hidden_layers,
                               use_attn_mask_offset=False)
    MTPProposer._update_mtp_config(proposer, main_model)
    draft = ModelRegistry.get_class(draft_config.model_config.architectures[0])(draft_config)
    draft.eval()
    seeded_weights(draft, rng)
    return draft


def caches_for(fd_config, model) -> list:
    """One key and one value cache per decoder layer in FastDeploy's layout."""
    mc = fd_config.model_config
    kv_heads, head_dim = int(mc.num_key_value_heads), int(mc.head_dim)
    caches = []
    for _ in range(int(mc.num_hidden_layers) + 1):          # + an MTP draft layer
        caches += [paddle.zeros([64, kv_heads, 16, head_dim], dtype="float32") for _ in range(2)]
    return caches


def run_model(spec_model: dict, out: Path) -> dict:
    import drive
    import fdctx
    from fastdeploy.model_executor.forward_meta import ForwardMeta
    from fastdeploy.model_executor.models.model_base import ModelRegistry

    from fd_routing_replay.integrations.fastdeploy.setup import moe_layer_map

    rng = np.random.default_rng(spec_model["seed"])
    work = Path(tempfile.mkdtemp(prefix=f"{spec_model['name']}-", dir=out))     # the test's tmp dir
    os.chdir(work)
    try:
        fd_config = fd_config_for(spec_model, work)
    except Exception as exc:  # noqa: BLE001 - FastDeploy's own config code refusing the model
        frames = traceback.extract_tb(exc.__traceback__)
        where = next((f for f in reversed(frames) if "/fastdeploy/" in f.filename), frames[-1])
        return {"status": "fastdeploy-config-error", "error": f"{type(exc).__name__}: {exc}",
                "where": f"{where.filename.split('/fastdeploy/', 1)[-1]}:{where.lineno} {where.name}",
                "line": where.line}
    paddle.seed(spec_model["seed"])
    model = ModelRegistry.get_class(spec_model["config"]["architectures"][0])(fd_config)
    model.eval()
    seeded_weights(model, rng)
    # What FastDeploy does after loading weights: the dummy loader's final step
    # (model_loader/dummy_loader.py:104, utils.py:247-272) and the per-layer step its weight
    # loader runs for MLA's KVBatchLinear (utils.py:175-176).
    from fastdeploy.model_executor.layers.linear import KVBatchLinear
    from fastdeploy.model_executor.utils import process_final_after_loading

    process_final_after_loading(model, fd_config)
    for sublayer in model.sublayers():
        if isinstance(sublayer, KVBatchLinear):
            sublayer.process_weights_after_loading()
    selections = spec_model["selections"]
    _, runner, engine = drive.install(fd_config, model)
    mla = getattr(fd_config.model_config, "kv_lora_rank", None)
    backend = (cpu_kernels.MLAAttentionBackend if mla else cpu_kernels.PagedAttentionBackend)(fd_config, 16)
    caches = caches_for(fd_config, model)
    draft = build_draft(fd_config, model, rng) if spec_model.get("draft") else None
    draft_calls: list[int] = []
    vocab = int(fd_config.model_config.vocab_size)
    state = {"next": None, "forwarded": []}
    prompt = rng.integers(3, min(vocab, 800), spec_model["prompt_len"]).astype(np.int64)
    image = spec_model.get("image")
    features = None
    if image is not None:           # placeholder tokens; their features stand in for the vision encoder's
        prompt[image["start"]: image["start"] + image["length"]] = image["token_id"]
        features = rng.standard_normal((image["length"], image["features"])).astype(np.float32)

    def forward(meta, step, n, cached):
        tokens = prompt[cached: cached + n] if cached < len(prompt) else np.array([state["next"]], np.int64)
        state["forwarded"].append(tokens.copy())
        ids = paddle.to_tensor(tokens)
        share = runner.share_inputs
        bsz = share["block_tables"].shape[0]
        lens = np.zeros(bsz, np.int32)
        lens[0] = n
        fields = dict(
            ids_remove_padding=ids, attn_backend=backend, caches=caches, block_tables=share["block_tables"],
            seq_lens_this_time=paddle.to_tensor(lens),
            seq_lens_decoder=paddle.to_tensor(np.array([cached] + [0] * (bsz - 1), np.int32)),
            seq_lens_encoder=paddle.to_tensor(np.array([n if cached < len(prompt) else 0] + [0] * (bsz - 1), np.int32)),
            cu_seqlens_q=paddle.to_tensor(np.array([0] + [n] * bsz, np.int32)),
            batch_id_per_token=meta.batch_id_per_token, position_ids=meta.position_ids,
            # [max tokens, max encoder tokens, max decoder tokens] of the step (MLA models branch on them)
            max_len_tensor_cpu=paddle.to_tensor(np.array([n, n if cached < len(prompt) else 0,
                                                          1 if cached >= len(prompt) else 0, cached + n, 0], np.int32)))
        known = {f.name for f in dataclasses.fields(ForwardMeta)}
        forward_meta = ForwardMeta(**{k: v for k, v in fields.items() if k in known})
        for key, value in fields.items():            # fields this FastDeploy version's ForwardMeta lacks
            if key not in known:
                setattr(forward_meta, key, value)
        if drive.STEP:
            forward_meta.device_routing_buffer = meta.device_routing_buffer
        else:
            forward_meta.routing_replay_table = meta.routing_replay_table
        selections.calls.clear()
        step_features = None
        if image is not None and cached < len(prompt):
            first, last = max(cached, image["start"]), min(cached + n, image["start"] + image["length"])
            if last > first:
                step_features = paddle.to_tensor(features[first - image["start"]: last - image["start"]])
        arch = spec_model["config"]["architectures"][0]
        inputs = {"ids_remove_padding": ids}
        if image is not None or "VL" in arch:
            inputs["image_features"] = step_features
        if "inputs" in inspect.signature(model.forward).parameters:        # the model's own entry
            hidden = model(inputs, forward_meta)
        else:                                                           # 2.5's multimodal signature
            hidden = model(**inputs, forward_meta=forward_meta)
        logits = model.compute_logits(hidden)
        state["next"] = int(np.argmax(logits.numpy()[-1]))
        if draft is not None:     # the proposer's forward: its ForwardMeta has no routing buffer (mtp.py:667)
            main_calls, hook_calls = list(selections.calls), runner.routing_replay_manager.binding.calls
            selections.calls.clear()
            draft_meta = dataclasses.replace(forward_meta) if dataclasses.is_dataclass(forward_meta) else forward_meta
            draft_meta.device_routing_buffer = None
            if hasattr(draft_meta, "routing_replay_table"):
                draft_meta.routing_replay_table = None
            draft(ids_remove_padding=ids, previous_hidden_states=hidden, forward_meta=draft_meta)
            draft_calls.append(len(selections.calls))
            if runner.routing_replay_manager.binding.calls != hook_calls:
                raise AssertionError("the draft model's MoE layers reached the routing hook")
            selections.calls[:] = main_calls
        if arch.startswith("Ernie4_5_VL"):
            return vl_rows(selections.calls, tokens >= int(fd_config.model_config.im_patch_id),
                           int(fd_config.model_config.moe_num_experts[0]))
        return np.stack(selections.calls)

    request = drive.Request(prompt_len=spec_model["prompt_len"], new_tokens=spec_model["new_tokens"],
                            rollout_id=f"matrix_{spec_model['name']}:0:0", chunks=tuple(spec_model.get("chunks", ())))
    drive.run(work, Patch(), fd_config, runner, request, forward, seed=spec_model["seed"])
    hit = spec_model.get("prefix_hit")
    record = drive.finish(work, fd_config, runner, engine, request, close=not hit)
    computed = drive.expected_rows(request)
    arrays = {"record": record.ids, "computed": computed, "tokens": np.concatenate(state["forwarded"])}
    state["forwarded"].clear()
    if hit:
        # A second request whose first ``hit`` tokens are the first one's (the image among them):
        # a prefix-cache hit on its KV blocks, then its own tail.  Its record's prefix rows were
        # computed by the first request.
        prompt[hit:] = rng.integers(3, min(vocab, 800), len(prompt) - hit)
        if image is not None:
            prompt[image["start"]: image["start"] + image["length"]] = image["token_id"]
        fresh = np.setdiff1d(np.arange(64), request.blocks)[: len(request.blocks)]
        blocks = np.concatenate([request.blocks[: hit // 16], fresh]).astype("int32")[: len(request.blocks)]
        second = drive.Request(prompt_len=spec_model["prompt_len"], new_tokens=spec_model["new_tokens"],
                               rollout_id=f"matrix_{spec_model['name']}:1:0", cached=hit, blocks=blocks)
        drive.run(work, Patch(), fd_config, runner, second, forward, seed=spec_model["seed"])
        again = drive.finish(work, fd_config, runner, engine, second)
        arrays.update(hit_record=again.ids, hit_computed=np.concatenate(
            [computed[:, :hit], drive.expected_rows(second)], axis=1))
    binding = runner.routing_replay_manager.binding
    hook = {"errors": binding.errors, "mismatches": binding.mismatches}
    np.savez(out / f"{spec_model['name']}.npz", **arrays)
    _ = fdctx
    return {"status": "ran", "kernels": dict(cpu_kernels.CALLS), "layers": list(record.layers), "num_experts": record.num_experts,
            "dtype": str(record.ids.dtype), "metadata": {k: v for k, v in record.metadata.items()
                                                          if isinstance(v, (int, str, list, dict))},
            "hook": hook, "layer_map": list(moe_layer_map(fd_config.model_config)),
            "num_decoder_layers": record.num_decoder_layers, "draft_selections": draft_calls}


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = Path(spec["out"])
    from fastdeploy.worker.worker_process import init_distributed_environment

    init_distributed_environment()                # fleet's groups, as FastDeploy's worker starts
    paddle.set_default_dtype("float32")
    cpu_kernels.install_model_stand_ins()
    selections = Selections()
    cpu_kernels.record_selections(selections)
    for spec_model in spec["models"]:
        spec_model["selections"] = selections
        cpu_kernels.CALLS.clear()
        try:
            result = run_model(spec_model, out)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which names the model
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}",
                      "traceback": traceback.format_exc()[-6000:]}
        (out / f"{spec_model['name']}.json").write_text(json.dumps(result, default=str))
    _ = SimpleNamespace


if __name__ == "__main__":
    main()
