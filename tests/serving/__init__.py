"""Serving-plane tests (a package, so its conftest and helpers get unique module names)."""
