"""One job over many processes: shards of an input, and merging their results into one output."""
