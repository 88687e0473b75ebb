"""An engine harness around a tiny Paddle MoE model, to prove capture correct end to end.

It plays FastDeploy's runner and engine at toy scale on the CPU (continuous batching,
chunked prefill, prefix caching, preemption, speculation, PD disaggregation) with either
capture generation, and checks the stored records against a teacher-forced forward; it
also runs ``python -m fdrr_dev demo``.  See docs/harness.md.
"""
