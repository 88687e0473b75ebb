"""Building blocks of :class:`fd_routing_replay.writer.RoutingWriter`.

``operation`` (one operation, as submitted, sent, spilled and journaled; the put checks),
``ring`` (shared-memory byte ring), ``transport`` (control messages, thread/process
links), ``worker`` (the store side: ordering, retries, spill, replay), ``turns``
(``only_last_turn`` retirement), ``journal`` (spill and dead-letter files), ``retry``
(retry and backoff policy objects), ``logs`` (rate-limited error lines) and ``metrics``.
"""
