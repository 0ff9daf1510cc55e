"""An e2e test that fails leaves its evidence: the fixtures learn in their teardown that the
test failed (``e2e.fixtures.failed``), in setup or in the call, and only then."""

from __future__ import annotations

import pytest

_PROBE = """
import pytest
from e2e.fixtures import failed

SEEN = {}

@pytest.fixture
def probe(request):
    yield
    SEEN[request.node.name] = failed(request)

def test_passes(probe):
    pass

def test_fails(probe):
    assert False

def test_zz_report():
    assert SEEN == {"test_passes": False, "test_fails": True}
"""


def test_teardowns_know_whether_the_test_failed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_probe=_PROBE)
    result = pytester.runpytest_inprocess("-p", "e2e.fixtures", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
