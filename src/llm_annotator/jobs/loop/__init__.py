"""One run in this process: rows out to the client, answers into the store, ``report.json``."""
