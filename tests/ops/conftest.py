"""The ``gpu`` marker of the compiled-mode Pallas test classes.

A test class with ``INTERPRET = False`` compiles its kernels (``tests/ops/test_pallas_kernels.py``)
and its ``…Interpret`` subclass runs the same bodies interpreted. A marker on the class would pass
on to the subclass, so the compiled classes' tests get ``gpu`` here, before ``-m`` selects.
"""

import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if getattr(item.cls, "INTERPRET", None) is False:
            item.add_marker(pytest.mark.gpu)
