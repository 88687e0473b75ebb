"""The floor everything stands on: redaction, atomic files, strict parsing, per-rank path
templates and the one health-check result type; no other part of the package is imported."""
