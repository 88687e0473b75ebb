"""Helpers for tests and benchmarks: throwaway servers on loopback (:mod:`.servers`).

Never imported by the runtime package.  The Redis helpers need redis-py (the ``redis`` or
``test`` extra); it is imported when a Redis server is first talked to, so the Mooncake
helpers work without it.
"""
