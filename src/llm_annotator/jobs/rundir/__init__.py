"""The run directory on disk: the results store, the fingerprint, the consolidated output."""
