"""Building blocks of :class:`fd_routing_replay.writer.RoutingWriter`.

``ring`` (shared-memory byte ring), ``transport`` (control messages, thread/process
links), ``worker`` (the store side: ordering, retries, spill, replay), ``journal`` (spill
and dead-letter files), ``retry`` (retry and backoff policy objects) and ``metrics``.
"""
