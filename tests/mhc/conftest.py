"""The mHC tests' conftest: pytest rewrites the asserts of the helper module the op files share
(``mhc_testing.py``, which holds the checks every op module runs), as it does those of the test files."""

import pytest

pytest.register_assert_rewrite("mhc_testing")
