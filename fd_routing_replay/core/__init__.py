"""The floor everything stands on: redaction, atomic files, strict parsing, per-rank path
templates, the one health-check result type and the build of the compiled libraries; no
other part of the package is imported."""
