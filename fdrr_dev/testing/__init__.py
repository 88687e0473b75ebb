"""Helpers for tests and benchmarks: throwaway Redis and Mooncake servers on free loopback
ports, started and stopped by this process.

Never imported by the runtime package.  The Redis helpers need redis-py (the ``redis`` or
``test`` extra), imported when a Redis server is first talked to, so the Mooncake helpers
work without it.
"""
