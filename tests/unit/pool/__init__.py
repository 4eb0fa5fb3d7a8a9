"""The pool: dispatch, health, eviction, failure decisions and discovery."""
