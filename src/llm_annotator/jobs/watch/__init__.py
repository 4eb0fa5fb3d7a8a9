"""Seeing a run while it goes: its counts, timeline, ``status.json`` and live metrics."""
