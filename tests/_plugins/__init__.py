"""pytest plugins of the cann_ops_tilelang test suite (loaded by tests/conftest.py; see README.md)."""
