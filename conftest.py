"""Repository-wide pytest configuration: shared fixture modules live in tests/fixtures/."""

pytest_plugins: list[str] = [
    "pytester",
    "e2e.fixtures",
    "tests.fixtures.gcs",
    "tests.fixtures.tmpfs",
    "tests.fixtures.sidecar",
    "e2e.operator_fixtures",
]
