"""The soak rig (issue #33): producers, trainers and a deleting driver sharing one store,
with faults injected, every record checked byte for byte and accounted for.

``python -m benchmarks.soak.run --short`` is the CI form (``make soak-short``),
``python -m benchmarks.soak.run`` the long one (``make soak``); docs/benchmarks.md has the
numbers and docs/operations.md ("Capacity") what they mean for an operator.

Modules: :mod:`.workload` (rollout ids, the size mix, records generated from the rollout
id alone), :mod:`.verify` (checks a read against the generator), :mod:`.events` (the
JSON-lines logs the processes talk through), :mod:`.accounting` (what happened to every
record), :mod:`.producer` / :mod:`.trainer` / :mod:`.fastdeploy_producer` / :mod:`.raw`
(the processes), :mod:`.stores` (servers and store configs), :mod:`.faults`,
:mod:`.scenario` (one scenario: start, drive, delete, stop) and :mod:`.run` (the CLI and
the report).
"""
