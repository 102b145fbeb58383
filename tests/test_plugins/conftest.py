"""Fixtures for the plugins' own tests."""

import pytest

from _plugins import device as _device
from _plugins.testing import ENV_VARS, write_inner_tree


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester tree whose conftest loads the plugins (not references), with a clean environment.

    The accelerator is hidden (device_type() -> None) so the inner runs behave the same on every host;
    tests that need another answer monkeypatch ``_plugins.device._DEVICE_TYPE``.
    """
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_device, "_DEVICE_TYPE", None)
    write_inner_tree(pytester)
    return pytester
