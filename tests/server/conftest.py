"""Fixtures for the server tests live in tests/conftest.py (shared with the frontend's live tests)."""
