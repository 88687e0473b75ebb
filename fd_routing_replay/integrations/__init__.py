"""Engine integrations; each module imports its engine lazily, inside functions."""
