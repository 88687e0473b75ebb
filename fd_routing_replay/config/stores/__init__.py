"""Light declarations of the built-in store backends (config sections and catalogue entries)."""
