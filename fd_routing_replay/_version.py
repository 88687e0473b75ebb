"""The package version, importable from every floor without loading the package's API."""

__version__ = "0.1.0"
