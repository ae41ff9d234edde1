"""Integration tests against the real peers (a package, so its conftest does not shadow tests/conftest.py)."""
