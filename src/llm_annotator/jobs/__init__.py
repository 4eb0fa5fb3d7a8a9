"""Annotation jobs: rows in, prompts rendered, answers checked, results stored once."""
