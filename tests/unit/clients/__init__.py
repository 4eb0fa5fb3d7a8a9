"""The client layer: requests, answers, options and what a server may send."""
