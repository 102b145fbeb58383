"""The Engram tests' helper module gets pytest's assertion rewriting (the tests it shares are defined there)."""

import pytest

pytest.register_assert_rewrite("engram_testing")
