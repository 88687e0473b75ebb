"""Development tools of fd-routing-replay, kept out of the runtime wheel.

``fdrr_dev.harness`` is a tiny CPU engine around a Paddle MoE model that plays FastDeploy's
runner and engine to prove capture end to end (and runs the demo); ``fdrr_dev.testing``
starts throwaway Redis and Mooncake servers and FastDeploy's stand-ins for tests and
benchmarks.  ``python -m fdrr_dev demo`` and ``python -m fdrr_dev r3-effect`` run from a
checkout (``make demo``); the wheel a FastDeploy host installs carries neither.
"""
