"""Test and demo support, never on the runtime import path of the trainer or the sidecar.

:mod:`~strata.testing.emulator` wraps fake-gcs-server (a real GCS emulator process) for tests,
benchmarks and the demo; :mod:`~strata.testing.demo` is ``python -m strata.demo``. Nothing under
``strata`` outside this package imports it.
"""
