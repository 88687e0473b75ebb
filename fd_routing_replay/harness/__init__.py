"""An engine harness around a tiny Paddle MoE model, to prove capture correct end to end.

``model`` (the tiny MoE transformer), ``kv`` (paged blocks with prefix caching),
``runner`` (FastDeploy's runner order and tensors), ``engine`` (continuous batching,
chunked prefill, preemption, aborts, speculation), ``rollouts`` (multi-turn RL rollouts),
``fidelity`` (the trainer-side check), ``session`` (wiring) and ``demo`` (``fd-rr demo``).
"""
