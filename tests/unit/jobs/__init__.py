"""The job layer: rows in, answers checked, the run directory, shards and watching."""
