"""An engine harness around a tiny Paddle MoE model, to prove capture correct end to end.

``model`` (the tiny MoE transformer), ``kv`` (paged blocks with prefix caching and a CPU
tier), ``runner`` (FastDeploy's runner order and tensors, 2.5's manager or 2.6's step
capturer), ``engine`` (continuous batching, chunked prefill, preemption, aborts,
speculation), ``slot_routing`` (2.6's engine side: records from the host slot cache),
``disaggregation`` (prefill → decode hand-over), ``cpu_cache`` (GPU ↔ CPU block swaps),
``rollouts`` (multi-turn RL rollouts), ``fidelity`` (the trainer-side check), ``session``
(wiring) and ``demo`` (``fd-rr demo``).  See docs/harness.md.
"""
