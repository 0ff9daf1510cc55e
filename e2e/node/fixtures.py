"""pytest fixtures of the real node (import them into a test module).

- ``strata_images`` (session): Strata's images built from their Dockerfiles (`e2e.node.images`),
  ``{name: BuiltImage}``; cached across sessions.
- ``real_node`` (module): a `RealNode` joined to the session's ``k8s_cluster``, Strata's images
  imported into its containerd (`POD_IMAGES`); stopped at the end of the module, and the test errors when
  anything of it is left on the machine.
- ``node_pair`` (module): two real nodes (`e2e.node.pair.NodePair`) joined to ``k8s_cluster``, their
  pods routed to each other and named by the pair's DNS, `POD_IMAGES` imported into both; stopped
  at the end of the module, and the test errors when anything of either is left on the machine.

A missing prerequisite (root, containerd, runc, CNI plugins, mmdebstrap, the kubelet build) skips
the requesting test with the reason, or fails it when ``STRATA_REQUIRE_E2E`` is set (CI).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.cluster import LocalCluster
from e2e.fixtures import REQUIRE_E2E_ENV
from e2e.node.harness import NodeUnavailable, RealNode, missing_prerequisites
from e2e.node.images import IMAGES, BuiltImage, ImageBuildError, build_image
from e2e.node.pair import NodePair

POD_IMAGES = ("strata.dev/sidecar:e2e", "strata.dev/trainer:e2e")
"""Images imported into the node (the operator runs as a local process in these tests)."""


def unavailable(reason: str) -> None:
    if os.environ.get(REQUIRE_E2E_ENV):
        pytest.fail(f"{reason} ({REQUIRE_E2E_ENV} is set, so the real-node tests must run)")
    pytest.skip(f"{reason} (set {REQUIRE_E2E_ENV}=1 to turn this skip into a failure)")


@pytest.fixture(scope="session")
def strata_images(request: pytest.FixtureRequest) -> dict[str, BuiltImage]:
    if os.geteuid() != 0:
        unavailable("building images needs root (chroot, bind mounts)")
    if shutil.which("mmdebstrap") is None:
        unavailable("mmdebstrap is missing (apt-get install mmdebstrap)")
    built: dict[str, BuiltImage] = {}
    for spec in IMAGES:
        try:
            built[spec.name] = build_image(spec)
        except ImageBuildError as exc:
            pytest.fail(f"image {spec.name} failed to build: {exc}")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for img in built.values():
            how = "cached" if img.cached else "built"
            reporter.write_line(f"image {img.name} {how} in {img.seconds:.1f} s")
    return built


@pytest.fixture(scope="module")
def real_node(
    k8s_cluster: LocalCluster,
    strata_images: dict[str, BuiltImage],
    request: pytest.FixtureRequest,
) -> Iterator[RealNode]:
    missing = missing_prerequisites(k8s_cluster.bin_dir)
    if missing:
        unavailable("real node prerequisites missing: " + "; ".join(missing))
    # A short directory: containerd's socket path must fit in 108 bytes.
    directory = Path(tempfile.mkdtemp(prefix="strata-node-"))
    node = RealNode(k8s_cluster, directory)
    try:
        seconds = node.start()
    except NodeUnavailable as exc:
        unavailable(str(exc))
    imports = {}
    try:
        for name in POD_IMAGES:
            imports[name] = node.import_image(strata_images[name].archive)
    except BaseException:
        node.stop()
        shutil.rmtree(directory, ignore_errors=True)
        raise
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"real node {node.name} Ready in {seconds:.1f} s ({node.timings}); images imported "
            f"in {', '.join(f'{n} {s:.1f} s' for n, s in imports.items())}"
        )
    node.timings.update({f"import {n}": s for n, s in imports.items()})
    try:
        yield node
    finally:
        node.stop()
        left = node.leftovers()
        if not left:
            shutil.rmtree(directory, ignore_errors=True)
        assert not left, f"the real node left behind: {left}"


@pytest.fixture(scope="module")
def node_pair(
    k8s_cluster: LocalCluster,
    strata_images: dict[str, BuiltImage],
    request: pytest.FixtureRequest,
) -> Iterator[NodePair]:
    missing = missing_prerequisites(k8s_cluster.bin_dir)
    if missing:
        unavailable("real node prerequisites missing: " + "; ".join(missing))
    pair = NodePair(k8s_cluster)
    try:
        seconds = pair.start()
    except NodeUnavailable as exc:
        unavailable(str(exc))
    try:
        begin = time.monotonic()
        imports = pair.import_images({n: strata_images[n].archive for n in POD_IMAGES})
        pair.timings.update({f"import {k}": v for k, v in imports.items()})
        pair.timings["images imported (both nodes)"] = time.monotonic() - begin
    except BaseException:
        pair.stop()
        raise
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(
            f"real node pair {[n.name for n in pair.nodes]} Ready in {seconds:.1f} s "
            f"(subnets {[str(n.subnet) for n in pair.nodes]}); timings "
            + ", ".join(f"{k} {v:.1f} s" for k, v in pair.timings.items())
        )
    try:
        yield pair
    finally:
        stopping = time.monotonic()
        pair.stop()
        if reporter is not None:
            reporter.write_line(f"real node pair stopped in {time.monotonic() - stopping:.1f} s")
        left = pair.leftovers()
        assert not left, f"the real node pair left behind: {left}"
