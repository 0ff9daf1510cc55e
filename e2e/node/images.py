"""Build Strata's images from the project's Dockerfiles without a container engine.

No Docker daemon and no registry exist here, so this module interprets the Dockerfile itself (the
Dockerfile stays the one definition of each image):

* ``FROM <ref> [AS <name>]`` where ``<ref>`` may use ``ARG``s (``--build-arg`` overrides): the
  ref names either a previous stage or a base rootfs this module knows how to make
  (`BASE_IMAGES`; the default ``strata.dev/debian-python:bookworm`` is ``mmdebstrap
  --variant=minbase bookworm`` with Debian's python3 3.11, venv and pip);
* ``ARG``, ``ENV``, ``WORKDIR``, ``USER``, ``LABEL``, ``EXPOSE``, ``ENTRYPOINT``, ``CMD`` into the
  image config; ``COPY [--from=<stage>] <src>... <dest>`` from the build context or a stage;
  ``RUN`` (shell form) by ``chroot`` into the stage's rootfs with ``/proc``, ``/dev`` and the
  host's ``/etc/resolv.conf`` bound for the duration (pip reaches its index from there);
* anything else (``ADD``, ``HEALTHCHECK``, ``ONBUILD``, ``VOLUME``, ``SHELL``...) is refused with
  `ImageBuildError` rather than ignored.

The result is an OCI image archive (``oci-layout``, ``index.json``, ``blobs/sha256``) of two
uncompressed layers: the base rootfs and the final stage's changes to it (whiteouts for deleted
paths), with the ``io.containerd.image.name`` annotation so ``ctr images import`` names it.
Archives are cached in ``${STRATA_CACHE:-~/.cache/strata}/images`` under a key of the Dockerfile,
the build arguments and every file of the build context the Dockerfile copies; a warm build is a
cache hit. Building needs root (chroot, bind mounts) and, for the base, ``mmdebstrap``.

Command line: ``python -m e2e.node.images [--only NAME ...]`` builds `IMAGES` and prints the
archives (``make images``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fnmatch
import hashlib
import io
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

from e2e.cluster import REPO_ROOT

DEFAULT_BASE: Final = "strata.dev/debian-python:bookworm"
BASE_IMAGES: Final = {
    DEFAULT_BASE: [
        "mmdebstrap",
        "--variant=minbase",
        "--include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates",
        "--mode=root",
        "--format=tar",
        "bookworm",
    ],
}
"""Base rootfs refs this builder can make, and the command that writes each as a tar (the
output path is appended). The Dockerfiles' ``BASE_IMAGE`` argument is set to one of them."""

MIRROR: Final = "http://deb.debian.org/debian"


@dataclasses.dataclass(frozen=True)
class ImageSpec:
    """One image of the project: its name, Dockerfile (relative to the repository) and build
    arguments."""

    name: str
    dockerfile: str
    build_args: tuple[tuple[str, str], ...] = (("BASE_IMAGE", DEFAULT_BASE),)


IMAGES: Final = (
    ImageSpec("strata.dev/sidecar:e2e", "sidecar/Dockerfile"),
    ImageSpec("strata.dev/operator:e2e", "operator/Dockerfile"),
    ImageSpec("strata.dev/trainer:e2e", "e2e/node/trainer.Dockerfile"),
)


class ImageBuildError(RuntimeError):
    """A Dockerfile could not be built; the message names the instruction and the cause."""


def cache_dir() -> Path:
    d = Path(os.environ.get("STRATA_CACHE") or Path.home() / ".cache" / "strata") / "images"
    d.mkdir(parents=True, exist_ok=True)
    return d


# --------------------------------------------------------------------------- base rootfs


def base_rootfs(ref: str) -> Path:
    """The tar of the base rootfs ``ref`` (built with its `BASE_IMAGES` command once, cached)."""
    if ref not in BASE_IMAGES:
        raise ImageBuildError(
            f"FROM {ref}: no registry is reachable here and {ref!r} is not a base this builder can"
            f" make; pass --build-arg BASE_IMAGE=<one of {sorted(BASE_IMAGES)}>"
        )
    argv = BASE_IMAGES[ref]
    key = hashlib.sha256(json.dumps([argv, MIRROR]).encode()).hexdigest()[:16]
    out = cache_dir() / f"base-{key}.tar"
    if out.is_file():
        return out
    if shutil.which(argv[0]) is None:
        raise ImageBuildError(f"FROM {ref}: {argv[0]} is missing (apt-get install {argv[0]})")
    tmp = out.with_suffix(".tmp.tar")
    begin = time.monotonic()
    proc = subprocess.run([*argv, str(tmp), MIRROR], capture_output=True, text=True)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ImageBuildError(f"FROM {ref}: {' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    tmp.rename(out)
    print(
        f"[images] base {ref} built in {time.monotonic() - begin:.0f} s -> {out}", file=sys.stderr
    )
    return out


def _sha256_file(path: Path) -> str:
    """sha256 hex of a file, cached next to it (``<file>.sha256``) while its size and mtime hold."""
    st = path.stat()
    memo = path.with_name(path.name + ".sha256")
    tag = f"{st.st_size}:{st.st_mtime_ns}"
    if memo.is_file():
        saved_tag, _, digest = memo.read_text().partition(" ")
        if saved_tag == tag:
            return digest.strip()
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    memo.write_text(f"{tag} {h.hexdigest()}")
    return h.hexdigest()


# --------------------------------------------------------------------------- Dockerfile


@dataclasses.dataclass
class Instruction:
    keyword: str
    args: str
    line: int

    def __str__(self) -> str:
        return f"line {self.line}: {self.keyword} {self.args}"


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions of a Dockerfile: comments dropped, ``\\`` continuations joined."""
    out: list[Instruction] = []
    buf = ""
    start = 0
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if buf and line.lstrip().startswith("#"):
            continue
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        keyword, _, rest = buf.strip().partition(" ")
        out.append(Instruction(keyword.upper(), rest.strip(), start))
        buf = ""
    if buf:
        raise ImageBuildError(f"line {start}: continuation at the end of the Dockerfile")
    return out


def substitute(text: str, env: dict[str, str]) -> str:
    """``$VAR`` and ``${VAR}`` from ``env`` (unknown names become empty, as in Docker)."""
    import re

    return re.sub(
        r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)\}|([A-Za-z_][A-Za-z0-9_]*))",
        lambda m: env.get(m.group(1) or m.group(2), ""),
        text,
    )


def _pairs(args: str, env: dict[str, str]) -> list[tuple[str, str]]:
    """``k=v k2="v 2"`` (or the legacy ``k v`` form) after substitution."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return [(words[0], substitute(" ".join(words[1:]), env))]
    out = []
    for w in words:
        k, _, v = w.partition("=")
        out.append((k, substitute(v, env)))
    return out


def _json_or_shell(args: str) -> list[str]:
    if args.startswith("["):
        value = json.loads(args)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ImageBuildError(f"not a JSON list of strings: {args}")
        return value
    return ["/bin/sh", "-c", args]


DEFAULT_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


@dataclasses.dataclass
class Stage:
    name: str
    rootfs: Path
    base_tar: Path
    env: dict[str, str] = dataclasses.field(default_factory=lambda: {"PATH": DEFAULT_PATH})
    args: dict[str, str] = dataclasses.field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    labels: dict[str, str] = dataclasses.field(default_factory=dict)
    exposed: list[str] = dataclasses.field(default_factory=list)
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    snapshot: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    history: list[str] = dataclasses.field(default_factory=list)


def _ignore_patterns(context: Path) -> list[str]:
    f = context / ".dockerignore"
    if not f.is_file():
        return []
    return [
        ln.strip() for ln in f.read_text().splitlines() if ln.strip() and not ln.startswith("#")
    ]


def _ignored(rel: str, patterns: list[str]) -> bool:
    for pat in patterns:
        p = pat.lstrip("/")
        if fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p + "/*"):
            return True
        if p.startswith("**/"):
            tail = p[3:]
            parts = rel.split("/")
            if any(fnmatch.fnmatch(part, tail) for part in parts):
                return True
    return False


def _context_files(context: Path, src: str, patterns: list[str]) -> list[Path]:
    root = (context / src).resolve()
    if not str(root).startswith(str(context.resolve())):
        raise ImageBuildError(f"COPY source {src} is outside the build context")
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise ImageBuildError(f"COPY source {src} does not exist in {context}")
    files = []
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(context))
        if p.is_file() and not _ignored(rel, patterns):
            files.append(p)
    return files


def _walk(rootfs: Path) -> dict[str, tuple[Any, ...]]:
    out: dict[str, tuple[Any, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(rootfs):
        for name in [*dirnames, *filenames]:
            full = os.path.join(dirpath, name)
            st = os.lstat(full)
            link = os.readlink(full) if stat.S_ISLNK(st.st_mode) else ""
            rel = os.path.relpath(full, rootfs)
            out[rel] = (st.st_mode, st.st_uid, st.st_gid, st.st_size, st.st_mtime_ns, link)
    return out


BUILD_HOST_FILES: Final = (
    "/etc/resolv.conf",
    "/etc/pip.conf",
    "/etc/ssl/certs/ca-certificates.crt",
)
"""Files of the build host bound (read-only) into a stage while a RUN executes, as a container
engine's build network would provide them: name resolution, pip's index settings and the CA
bundle that verifies the index (a TLS-intercepting proxy's CA included). None stays in the image."""


@contextlib.contextmanager
def _run_mounts(rootfs: Path) -> Iterator[None]:
    """/proc, /dev and `BUILD_HOST_FILES` inside ``rootfs`` while a RUN executes."""
    mounted: list[Path] = []
    created: list[Path] = []
    try:
        for target, argv in (
            (rootfs / "proc", ["mount", "-t", "proc", "proc"]),
            (rootfs / "dev", ["mount", "--bind", "/dev"]),
        ):
            target.mkdir(exist_ok=True)
            subprocess.run([*argv, str(target)], check=True)
            mounted.append(target)
        for host in BUILD_HOST_FILES:
            if not os.path.isfile(host):
                continue
            target = rootfs / host.lstrip("/")
            if target.is_symlink() or not target.exists():
                # A dangling link (resolv.conf) or no file: a placeholder removed afterwards.
                saved = os.readlink(target) if target.is_symlink() else None
                target.unlink(missing_ok=True)
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
                created.append(target)
                if saved is not None:
                    created_links[target] = saved
            subprocess.run(["mount", "--bind", "-o", "ro", host, str(target)], check=True)
            mounted.append(target)
        yield
    finally:
        for target in reversed(mounted):
            subprocess.run(["umount", "-l", str(target)], check=False)
        for target in created:
            target.unlink(missing_ok=True)
            if target in created_links:
                os.symlink(created_links.pop(target), target)


created_links: dict[Path, str] = {}


def _user_ids(stage: Stage) -> tuple[int, int]:
    if not stage.user or stage.user == "root":
        return 0, 0
    uid, _, gid = stage.user.partition(":")
    if not uid.isdigit() or (gid and not gid.isdigit()):
        raise ImageBuildError(f"USER {stage.user}: only numeric uid[:gid] is supported")
    return int(uid), int(gid or uid)


class Builder:
    """Builds one Dockerfile (see the module docstring) in a scratch directory."""

    def __init__(self, dockerfile: Path, context: Path, build_args: dict[str, str]) -> None:
        self.dockerfile = dockerfile
        self.context = context
        self.build_args = dict(build_args)
        self.instructions = parse_dockerfile(dockerfile.read_text())
        self.patterns = _ignore_patterns(context)

    def cache_key(self) -> str:
        """Of the Dockerfile, the build arguments, the base tars' commands and every context
        file a COPY reads."""
        h = hashlib.sha256(b"strata-image-builder-1\0")
        h.update(self.dockerfile.read_bytes())
        h.update(json.dumps(sorted(self.build_args.items())).encode())
        h.update(json.dumps([BASE_IMAGES, MIRROR], sort_keys=True).encode())
        for ins in self.instructions:
            if ins.keyword == "COPY" and "--from=" not in ins.args:
                words = [w for w in shlex.split(ins.args) if not w.startswith("--")]
                for src in words[:-1]:
                    for f in _context_files(self.context, src, self.patterns):
                        h.update(str(f.relative_to(self.context)).encode() + b"\0")
                        h.update(hashlib.sha256(f.read_bytes()).digest())
        return h.hexdigest()[:20]

    def build(self, image_name: str, out: Path) -> dict[str, Any]:
        """Build into the OCI archive ``out``; returns the image config."""
        with tempfile.TemporaryDirectory(prefix="strata-build-", dir=cache_dir()) as tmp:
            stages: dict[str, Stage] = {}
            stage: Stage | None = None
            global_args: dict[str, str] = {}
            for ins in self.instructions:
                kw = ins.keyword
                try:
                    if kw == "ARG" and stage is None:
                        for k, v in _pairs(ins.args, global_args):
                            global_args[k] = self.build_args.get(k, v)
                    elif kw == "FROM":
                        stage = self._from(ins, global_args, stages, Path(tmp))
                        stages[stage.name] = stage
                    elif stage is None:
                        raise ImageBuildError("instruction before FROM")
                    else:
                        self._apply(stage, ins, stages)
                except ImageBuildError as exc:
                    raise ImageBuildError(f"{self.dockerfile} {ins}: {exc}") from None
                except (OSError, subprocess.SubprocessError, ValueError) as exc:
                    raise ImageBuildError(f"{self.dockerfile} {ins}: {exc}") from exc
            if stage is None:
                raise ImageBuildError(f"{self.dockerfile}: no FROM")
            return write_oci_archive(stage, image_name, out, Path(tmp))

    def _from(
        self, ins: Instruction, global_args: dict[str, str], stages: dict[str, Stage], tmp: Path
    ) -> Stage:
        words = substitute(ins.args, global_args).split()
        ref = words[0]
        name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"stage{len(stages)}"
        rootfs = tmp / name
        rootfs.mkdir()
        if ref in stages:
            prev = stages[ref]
            subprocess.run(["cp", "-a", f"{prev.rootfs}/.", str(rootfs)], check=True)
            st = dataclasses.replace(prev, name=name, rootfs=rootfs, history=[*prev.history])
            st.env, st.labels, st.exposed = dict(prev.env), dict(prev.labels), list(prev.exposed)
            return st
        base = base_rootfs(ref)
        subprocess.run(["tar", "-xpf", str(base), "-C", str(rootfs), "--numeric-owner"], check=True)
        st = Stage(name=name, rootfs=rootfs, base_tar=base)
        st.snapshot = _walk(rootfs)
        st.history.append(f"FROM {ref}")
        return st

    def _path(self, stage: Stage, dest: str) -> Path:
        d = dest if dest.startswith("/") else os.path.join(stage.workdir, dest)
        return stage.rootfs / d.lstrip("/")

    def _apply(self, stage: Stage, ins: Instruction, stages: dict[str, Stage]) -> None:
        kw, scope = ins.keyword, {**stage.args, **stage.env}
        stage.history.append(f"{kw} {ins.args}")
        if kw == "ARG":
            for k, v in _pairs(ins.args, scope):
                stage.args[k] = self.build_args.get(k, v)
        elif kw == "ENV":
            for k, v in _pairs(ins.args, scope):
                stage.env[k] = v
        elif kw == "LABEL":
            stage.labels.update(_pairs(ins.args, scope))
        elif kw == "WORKDIR":
            stage.workdir = os.path.join(stage.workdir, substitute(ins.args, scope))
            self._path(stage, stage.workdir).mkdir(parents=True, exist_ok=True)
        elif kw == "USER":
            stage.user = substitute(ins.args, scope)
        elif kw == "EXPOSE":
            for port in substitute(ins.args, scope).split():
                stage.exposed.append(port if "/" in port else f"{port}/tcp")
        elif kw == "ENTRYPOINT":
            stage.entrypoint = _json_or_shell(ins.args)
        elif kw == "CMD":
            stage.cmd = _json_or_shell(ins.args)
        elif kw == "COPY":
            self._copy(stage, ins, stages, scope)
        elif kw == "RUN":
            self._run(stage, ins, scope)
        else:
            raise ImageBuildError(f"{kw} is not supported by this builder")

    def _copy(
        self, stage: Stage, ins: Instruction, stages: dict[str, Stage], scope: dict[str, str]
    ) -> None:
        words = [substitute(w, scope) for w in shlex.split(ins.args)]
        opts = {w.split("=", 1)[0]: w.split("=", 1)[1] for w in words if w.startswith("--")}
        words = [w for w in words if not w.startswith("--")]
        if set(opts) - {"--from"}:
            raise ImageBuildError(f"COPY options {sorted(set(opts) - {'--from'})} unsupported")
        *srcs, dest = words
        target = self._path(stage, dest)
        to_dir = dest.endswith("/") or len(srcs) > 1
        for src in srcs:
            if "--from" in opts:
                source_stage = stages.get(opts["--from"])
                if source_stage is None:
                    raise ImageBuildError(f"no stage named {opts['--from']}")
                s = source_stage.rootfs / src.lstrip("/")
                if not s.exists():
                    raise ImageBuildError(f"{src} does not exist in stage {opts['--from']}")
                if s.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    subprocess.run(["cp", "-a", f"{s}/.", str(target)], check=True)
                else:
                    dst = target / s.name if to_dir else target
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    subprocess.run(["cp", "-a", str(s), str(dst)], check=True)
                continue
            root = (self.context / src).resolve()
            for f in _context_files(self.context, src, self.patterns):
                if root.is_dir():
                    dst = target / f.relative_to(root)
                else:
                    dst = target / f.name if to_dir else target
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, dst)
                os.chown(dst, 0, 0)

    def _run(self, stage: Stage, ins: Instruction, scope: dict[str, str]) -> None:
        argv = _json_or_shell(ins.args)
        uid, gid = _user_ids(stage)
        workdir = stage.workdir
        rootfs = str(stage.rootfs)

        def enter() -> None:
            os.chroot(rootfs)
            os.chdir(workdir)
            if gid:
                os.setgid(gid)
            if uid:
                os.setuid(uid)

        env = {"HOME": "/root", **scope}
        with _run_mounts(stage.rootfs):
            proc = subprocess.run(
                argv, env=env, preexec_fn=enter, capture_output=True, text=True, timeout=1800
            )
        if proc.returncode != 0:
            raise ImageBuildError(
                f"exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-4000:]}"
            )


# --------------------------------------------------------------------------- OCI archive


def _layer_diff(stage: Stage, out: Path) -> None:
    """A tar of what ``stage.rootfs`` changed against its base snapshot (whiteouts for removed
    paths)."""
    now = _walk(stage.rootfs)
    before = stage.snapshot
    removed = sorted(set(before) - set(now))
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for rel in sorted(now):
            if before.get(rel) == now[rel]:
                continue
            info = tar.gettarinfo(str(stage.rootfs / rel), arcname=rel)
            info.uname = info.gname = ""
            if info.isreg():
                with (stage.rootfs / rel).open("rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
        for rel in removed:
            parent = os.path.dirname(rel)
            if parent and parent in removed:
                continue
            info = tarfile.TarInfo(os.path.join(parent, ".wh." + os.path.basename(rel)))
            tar.addfile(info, io.BytesIO(b""))


def _blob(tar: tarfile.TarFile, data: bytes) -> dict[str, Any]:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _file_blob(tar: tarfile.TarFile, path: Path) -> dict[str, Any]:
    digest = _sha256_file(path)
    tar.add(str(path), arcname=f"blobs/sha256/{digest}")
    return {"digest": f"sha256:{digest}", "size": path.stat().st_size}


def image_config(stage: Stage, diff_ids: list[str]) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "Env": [f"{k}={v}" for k, v in stage.env.items()],
        "WorkingDir": stage.workdir,
        "Labels": stage.labels,
    }
    if stage.user:
        cfg["User"] = stage.user
    if stage.exposed:
        cfg["ExposedPorts"] = {p: {} for p in stage.exposed}
    if stage.entrypoint is not None:
        cfg["Entrypoint"] = stage.entrypoint
    if stage.cmd is not None:
        cfg["Cmd"] = stage.cmd
    return {
        "architecture": "amd64",
        "os": "linux",
        "config": cfg,
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": [{"created_by": h} for h in stage.history],
    }


def write_oci_archive(stage: Stage, image_name: str, out: Path, tmp: Path) -> dict[str, Any]:
    """Pack ``stage`` as an OCI image archive at ``out``; returns the image config."""
    layer = tmp / "layer.tar"
    _layer_diff(stage, layer)
    layers = [stage.base_tar, layer]
    diff_ids = [f"sha256:{_sha256_file(p)}" for p in layers]
    config = image_config(stage, diff_ids)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w") as tar:
        layer_descs = [
            {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_file_blob(tar, p)}
            for p in layers
        ]
        cfg_desc = {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            **_blob(tar, json.dumps(config).encode()),
        }
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": cfg_desc,
            "layers": layer_descs,
        }
        man_desc = {
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            **_blob(tar, json.dumps(manifest).encode()),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {
                "io.containerd.image.name": image_name,
                "org.opencontainers.image.ref.name": image_name.rsplit(":", 1)[-1],
            },
        }
        for name, data in (
            ("oci-layout", json.dumps({"imageLayoutVersion": "1.0.0"}).encode()),
            ("index.json", json.dumps({"schemaVersion": 2, "manifests": [man_desc]}).encode()),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    partial.rename(out)
    return config


# --------------------------------------------------------------------------- entry points


@dataclasses.dataclass(frozen=True)
class BuiltImage:
    name: str
    archive: Path
    config: dict[str, Any]
    seconds: float
    cached: bool


def build_image(spec: ImageSpec, context: Path = REPO_ROOT) -> BuiltImage:
    """Build (or take from the cache) one of `IMAGES`."""
    begin = time.monotonic()
    builder = Builder(context / spec.dockerfile, context, dict(spec.build_args))
    key = builder.cache_key()
    slug = spec.name.rsplit("/", 1)[-1].replace(":", "-")
    archive = cache_dir() / f"{slug}-{key}.oci.tar"
    meta = archive.with_name(archive.name + ".config.json")
    if archive.is_file() and meta.is_file():
        return BuiltImage(
            spec.name, archive, json.loads(meta.read_text()), time.monotonic() - begin, True
        )
    config = builder.build(spec.name, archive)
    meta.write_text(json.dumps(config))
    return BuiltImage(spec.name, archive, config, time.monotonic() - begin, False)


def pause_image(bin_dir: Path) -> Path:
    """The pod sandbox image ``strata.dev/pause:e2e``: ``<bin_dir>/pause`` (built by
    ``e2e/build-tools.sh`` from e2e/node/pause) as ``/pause``, one layer, cached."""
    binary = bin_dir / "pause"
    if not binary.is_file():
        raise ImageBuildError(f"{binary} is missing (make tools builds it)")
    digest = _sha256_file(binary)[:16]
    out = cache_dir() / f"pause-{digest}.oci.tar"
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory(prefix="strata-pause-", dir=cache_dir()) as tmp:
        t = Path(tmp)
        base = t / "rootfs.tar"
        with tarfile.open(base, "w") as tar:
            info = tar.gettarinfo(str(binary), arcname="pause")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mode = 0o755
            with binary.open("rb") as f:
                tar.addfile(info, f)
        (t / "empty").mkdir()
        stage = Stage(name="pause", rootfs=t / "empty", base_tar=base, entrypoint=["/pause"])
        stage.user = "65535:65535"
        stage.history.append("pause from e2e/node/pause")
        write_oci_archive(stage, "strata.dev/pause:e2e", out, t)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="build Strata's images from their Dockerfiles")
    parser.add_argument("--only", action="append", default=[], help="image name (repeatable)")
    parser.add_argument("--base-only", action="store_true", help="only the base rootfs")
    args = parser.parse_args(argv)
    if args.base_only:
        print(base_rootfs(DEFAULT_BASE))
        return 0
    for spec in IMAGES:
        if args.only and spec.name not in args.only:
            continue
        try:
            img = build_image(spec)
        except ImageBuildError as exc:
            print(f"[images] FAILED {spec.name}: {exc}", file=sys.stderr)
            return 1
        how = "cached" if img.cached else "built"
        print(f"[images] {spec.name} {how} in {img.seconds:.0f} s: {img.archive}", file=sys.stderr)
        print(img.archive)
    return 0


if __name__ == "__main__":
    sys.exit(main())
