"""The R3 effect, measured: a bf16 Paddle engine against an fp32 ``transformers`` trainer.

1. **Engine** (Paddle): rollouts through the harness engine (FastDeploy 2.6's capture,
   continuous batching, paged KV, prefix cache, chunked prefill) with the tiny Qwen3-MoE
   of :mod:`.qwen3_moe` in **bf16 activations**, sampling at temperature 1; the runner's
   ``on_sample`` hands over each sampled token's logits row, so the engine's own
   log-probability of every response token is known.  The routes go through the real
   capture into a store and come back through :class:`~fd_routing_replay.reader.RoutingReader`
   (tokens hash checked).
2. **Trainer** (torch): ``Qwen3MoeForCausalLM.from_pretrained`` on the checkpoint the
   engine's weights were written to (:mod:`.hf_checkpoint`), in **fp32**, eager attention,
   the sequences as one right-padded batch, full causal attention (no paged cache).  It
   recomputes every sequence twice: with its own routers (replay off) and under
   :func:`~fd_routing_replay.trainers.hf.replay_routing` with the records (replay on).
   A forward pre-hook on every block's experts sees which experts each token *actually*
   went to.
3. **Metrics** (R3 paper's, Ma et al. 2025): a router decision is one (token, layer)
   top-k *set*; it differs when the trainer's set is not the record's.  Over every
   forwarded position of every sequence: the share of decisions that differ, the share of
   tokens with at least one differing layer, the mean number of differing layers per
   token (:func:`~fd_routing_replay.trainers.compare.compare_routing`).  Over the response
   tokens the engine sampled, with ``d = logp_trainer − logp_engine``: the k3 estimate of
   KL(engine ‖ trainer), ``mean(exp(d) − 1 − d)``, and ``max |d|``
   (:func:`~fd_routing_replay.trainers.compare.logprob_mismatch`).

The weights are bf16-exact, so both sides hold the same weights and differ only in
numerics: bf16 rounding of every activation against fp32, and paged, batched attention
against one full forward.  ``python -m fdrr_dev r3-effect`` prints the table (docs/trainer.md).
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fd_routing_replay.reader import RoutingReader
from fd_routing_replay.store import open_store
from fd_routing_replay.trainers.compare import compare_routing, logprob_mismatch
from fdrr_dev.harness.engine import EngineConfig
from fdrr_dev.harness.hf_checkpoint import load_hf_model, save_hf_checkpoint
from fdrr_dev.harness.qwen3_moe import TinyQwen3Config, TinyQwen3Moe
from fdrr_dev.harness.rollouts import RolloutDriver, RolloutPlan
from fdrr_dev.harness.wiring import build_engine, inline_writer

__all__ = ["ENGINE_NUMERICS", "TRAINER_NUMERICS", "R3Effect", "Sample", "engine_rollouts",
           "run_r3_effect", "trainer_pass"]

NAMESPACE = "r3-effect"
# Two fp32 trainer passes over the same experts: their k3 KLs to the engine differ by
# rounding only (~1e-14 measured; the fp32-engine control's KL itself is ~1e-13).
KL_ROUNDING = 1e-9
ENGINE_NUMERICS = ("Paddle, bf16 activations (every projection, norm, residual, router and "
                   "vocabulary logit and the KV cache rounded to bf16; fp32 accumulation and "
                   "softmax), paged KV, batched steps")
TRAINER_NUMERICS = "transformers Qwen3MoeForCausalLM, fp32, eager attention, one padded batch"


@dataclass
class Sample:
    """One finished rollout: its tokens, prompt length, record and the engine's logprobs
    of the response tokens (``tokens[prompt_len:]``)."""

    rollout_id: str
    tokens: list[int]
    prompt_len: int
    engine_logprobs: np.ndarray
    record: Any = None


@dataclass
class R3Effect:
    """Both rows of the table (``off``/``on``: replay), and what they were measured on."""

    off: dict[str, Any]
    on: dict[str, Any]
    sequences: int
    rollouts: int
    seed: int
    model: dict[str, Any]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """With replay the trainer applied exactly the recorded experts, and its KL to the
        engine is strictly lower wherever routing differed without replay.  Where no
        routing differed the two trainer passes apply the same experts and differ only in
        rounding (replay recomputes the weights at the given experts): the KLs must then
        agree within :data:`KL_ROUNDING`."""
        if self.on["flipped_decisions"] != 0:
            return False
        if self.off["flipped_decisions"] > 0:
            return self.on["k3_kl"] < self.off["k3_kl"]
        return abs(self.on["k3_kl"] - self.off["k3_kl"]) <= KL_ROUNDING

    def as_dict(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "seed": self.seed, "sequences": self.sequences,
                "model": self.model, "engine": ENGINE_NUMERICS, "trainer": TRAINER_NUMERICS,
                "replay_off": self.off, "replay_on": self.on, "passed": self.passed,
                "seconds": self.seconds}

    def table(self) -> str:
        """The side-by-side table, plain text."""
        rows = [
            ("router decisions that differ", "flip_rate", "{:.4f}"),
            ("tokens with >= 1 layer differing", "token_flip_share", "{:.4f}"),
            ("differing routers per token (mean)", "flipped_layers_per_token", "{:.4f}"),
            ("k3 KL(engine || trainer), response tokens", "k3_kl", "{:.3e}"),
            ("max |logp_trainer - logp_engine|", "max_abs_logprob_diff", "{:.4f}"),
        ]
        cells = [(name, fmt.format(self.off[key]), fmt.format(self.on[key]))
                 for name, key, fmt in rows]
        width = max(len(name) for name, _, _ in cells)
        lines = [f"{'metric':<{width}} | {'replay off':>10} | {'replay on':>10}",
                 f"{'-' * width}-+-{'-' * 10}-+-{'-' * 10}"]
        lines += [f"{name:<{width}} | {off:>10} | {on:>10}" for name, off, on in cells]
        m, off = self.model, self.off
        lines.append(
            f"{self.sequences} sequences ({self.rollouts} rollouts, seed {self.seed}); "
            f"{off['routed_tokens']} routed tokens x {off['num_layers']} MoE layers = "
            f"{off['decisions']} decisions; {off['tokens']} response tokens; Qwen3-MoE "
            f"{m['num_layers']} layers, {m['num_experts']} experts, top-{m['top_k']}")
        return "\n".join(lines)


def _logprob(logits: np.ndarray, token: int) -> float:
    scores = np.asarray(logits, dtype=np.float64)
    top = scores.max()
    return float(scores[token] - top - np.log(np.exp(scores - top).sum()))


def engine_rollouts(model: TinyQwen3Moe, plan: RolloutPlan, store: Any, writer: Any,
                    engine_config: EngineConfig | None = None) -> list[Sample]:
    """Run ``plan`` through a capturing harness engine around ``model`` (records written by
    ``writer`` into ``store``); the finished rollouts with the engine's logprobs, records
    attached."""
    engine_config = engine_config or EngineConfig(generation="step", temperature=1.0,
                                                  eos_bias=0.0)
    if engine_config.temperature != 1.0 or engine_config.eos_bias != 0.0:
        raise ValueError("the engine's logprobs are log_softmax(logits): sample at temperature "
                         f"1 without eos_bias (got {engine_config.temperature}, "
                         f"{engine_config.eos_bias})")
    engine = build_engine(model, engine_config, writer=writer)
    drawn: dict[tuple[int, int], tuple[int, float]] = {}

    def on_sample(seed: int, position: int, token: int, logits: np.ndarray) -> None:
        drawn[(seed, position)] = (token, _logprob(logits, token))

    engine.runner.on_sample = on_sample
    driver = RolloutDriver(plan, model.config.vocab_size, model.config.eos_token_id)
    results = driver.run(engine)
    requests = [engine.by_id[r.request_id] for r in results if r.finish_reason in ("eos", "length")]
    seeds = [request.seed for request in requests]
    if len(set(seeds)) != len(seeds):
        raise RuntimeError("two requests drew the same sampling seed: their logprobs cannot be "
                           "told apart; use another plan seed")
    reader = RoutingReader(store)
    samples = []
    for request in requests:
        prompt_len, tokens = len(request.prompt), list(request.tokens)
        logprobs = []
        for position in range(prompt_len, len(tokens)):
            token, logprob = drawn[(request.seed, position)]
            if token != tokens[position]:
                raise RuntimeError(f"{request.rollout_id}: position {position} holds token "
                                   f"{tokens[position]} but the engine sampled {token}")
            logprobs.append(logprob)
        record = reader.get(request.rollout_id)
        if record is None:
            raise RuntimeError(f"no record stored for {request.rollout_id}")
        record.check_tokens(np.asarray(tokens, dtype=np.int64))
        samples.append(Sample(request.rollout_id, tokens, prompt_len, np.asarray(logprobs),
                              record))
    return samples


@contextlib.contextmanager
def _used_experts(model: Any) -> Iterator[dict[int, Any]]:
    """Within the block, ``used[layer]`` is the ``[tokens, K]`` expert ids each MoE block
    handed to its experts in the last forward (the routing that was applied)."""
    from fd_routing_replay.trainers.hf import moe_routers

    used: dict[int, Any] = {}
    handles = []
    for router in moe_routers(model):
        experts = model.get_submodule(router.name.rsplit(".", 1)[0]).experts

        def grab(module: Any, args: Any, kwargs: Any, layer: int = router.layer) -> None:
            used[layer] = (args[1] if len(args) > 1 else kwargs["top_k_index"]).detach().clone()

        handles.append(experts.register_forward_pre_hook(grab, with_kwargs=True))
    try:
        yield used
    finally:
        for handle in handles:
            handle.remove()


def trainer_pass(model: Any, samples: list[Sample], *, replay: bool) -> tuple[np.ndarray, np.ndarray]:
    """Recompute ``samples`` (one right-padded batch) in ``model``; returns the experts used
    at every forwarded position, concatenated over the samples (``[L, ΣT, K]``), and the
    trainer's logprobs of the response tokens (concatenated in the samples' order)."""
    import torch

    from fd_routing_replay.trainers.hf import padded_routes, replay_routing

    lengths = [len(sample.tokens) for sample in samples]
    input_ids = torch.zeros((len(samples), max(lengths)), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, sample in enumerate(samples):
        input_ids[row, :lengths[row]] = torch.tensor(sample.tokens)
        mask[row, :lengths[row]] = 1
    replaying = replay_routing(model, padded_routes([s.record for s in samples], mask)) \
        if replay else contextlib.nullcontext()
    with torch.no_grad(), _used_experts(model) as used, replaying:
        logits = model(input_ids=input_ids, attention_mask=mask).logits
    logprobs = torch.log_softmax(logits.double(), dim=-1).numpy()
    ids = np.stack([used[layer].numpy().reshape(len(samples), max(lengths), -1)
                    for layer in sorted(used)])
    routes = np.concatenate([ids[:, row, :length - 1] for row, length in enumerate(lengths)],
                            axis=1)
    token_logprobs = np.concatenate([
        logprobs[row, np.arange(s.prompt_len - 1, lengths[row] - 1), s.tokens[s.prompt_len:]]
        for row, s in enumerate(samples)])
    return routes, token_logprobs


def _metrics(samples: list[Sample], routes: np.ndarray, logprobs: np.ndarray) -> dict[str, Any]:
    recorded = np.concatenate([np.asarray(s.record.ids) for s in samples], axis=1)
    first = samples[0].record
    routing = compare_routing(recorded, routes, num_experts=first.num_experts,
                              fill_value=first.fill_value)
    kl = logprob_mismatch(np.concatenate([s.engine_logprobs for s in samples]), logprobs)
    keep = ("flip_rate", "token_flip_share", "flipped_layers_per_token", "flipped_decisions",
            "decisions", "per_layer_flip_rate")
    return {**{key: routing[key] for key in keep}, **kl,
            "routed_tokens": int(recorded.shape[1]), "num_layers": int(recorded.shape[0])}


def run_r3_effect(*, rollouts: int = 32, seed: int = 0, workdir: str | Path | None = None,
                  model_config: TinyQwen3Config | None = None,
                  max_tokens: tuple[int, int] = (16, 32),
                  engine_activations: str = "bfloat16") -> R3Effect:
    """The whole experiment (module docstring).  ``workdir`` keeps the checkpoint
    (``checkpoint/``) and the local store (``store/``, namespace ``r3-effect``, cleared
    first); by default a temporary directory.  ``seed`` seeds the workload and, unless
    ``model_config`` is given, the weights.
    ``engine_activations="float32"`` runs the engine in fp32 too (the control: then only
    the attention order and batching differ)."""
    if rollouts < 1:
        raise ValueError(f"rollouts must be at least 1, got {rollouts}")
    config = replace(model_config or TinyQwen3Config(seed=seed),
                     activation_dtype=engine_activations)
    if config.mlp_only_layers:
        raise ValueError("the harness records number the MoE layers 0..L-1 (no layer map): "
                         f"run the experiment with every layer MoE, not mlp_only_layers="
                         f"{list(config.mlp_only_layers)}")
    with contextlib.ExitStack() as stack:
        root = Path(workdir) if workdir is not None else \
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fd-rr-r3-")))
        started = time.perf_counter()
        engine_model = TinyQwen3Moe(config)
        save_hf_checkpoint(engine_model, root / "checkpoint")
        store = stack.enter_context(open_store(f"local://{root / 'store'}", NAMESPACE))
        store.clear()
        plan = RolloutPlan(num_rollouts=rollouts, num_turns=1, seed=seed, max_tokens=max_tokens,
                           experiment="r3")
        writer = stack.enter_context(inline_writer(f"local://{root / 'store'}", NAMESPACE))
        samples = engine_rollouts(engine_model, plan, store, writer)
        if not samples:
            raise RuntimeError("no rollout finished: nothing to compare")
        engine_seconds = time.perf_counter() - started
        started = time.perf_counter()
        trainer = load_hf_model(root / "checkpoint")
        rows = {replay: _metrics(samples, *trainer_pass(trainer, samples, replay=replay))
                for replay in (False, True)}
        trainer_seconds = time.perf_counter() - started
    model = {"num_layers": config.num_layers, "num_experts": config.num_experts,
             "top_k": config.top_k, "hidden_size": config.hidden_size,
             "vocab_size": config.vocab_size}
    return R3Effect(off=rows[False], on=rows[True], sequences=len(samples), rollouts=rollouts,
                    seed=seed, model=model,
                    seconds={"engine": engine_seconds, "trainer": trainer_seconds})
