"""Connection URLs, auth, TLS, unix sockets, cluster detection, retry policy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tracestore import ConfigError, InvalidId, StorageError, TraceStore
from tracestore.connection import ConnectionOptions, parse_url, sync_client
from tracestore.servers import EmbeddedServer, TlsFiles, redis_server_binary


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("", "empty connection URL"),
        ("http://localhost:6379", "unsupported URL scheme 'http'"),
        ("localhost:6379", "unsupported URL scheme"),
        ("redis://", "without a host"),
        ("redis://localhost:99999", "(?i)port"),
        ("unix://", "without a socket path"),
        ("redis://user:secret@:6379", "without a host"),
    ],
)
def test_bad_urls_are_config_errors(url: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as exc:
        parse_url(url)
    assert "secret" not in str(exc.value)  # passwords are masked in messages


def test_url_forms() -> None:
    assert parse_url("redis+cluster://h:1").cluster is True
    assert parse_url("redis+cluster://h:1").url == "redis://h:1"
    assert parse_url("rediss+cluster://h:1").tls is True
    assert parse_url("redis://h:1").cluster is None  # detected with INFO cluster
    assert parse_url("unix:///tmp/x.sock").cluster is False
    assert parse_url("redis://u:pw@h:1").display == "redis://u:***@h:1"


def test_unreachable_server_is_a_storage_error() -> None:
    with pytest.raises(StorageError, match="cannot reach redis://127.0.0.1:1"):
        TraceStore.connect("redis://127.0.0.1:1", run="r", retries=0, connect_timeout_s=1)


def test_bad_run_id_and_options_fail_before_io() -> None:
    with pytest.raises(InvalidId):
        TraceStore.connect("redis://127.0.0.1:1", run="bad run")
    with pytest.raises(ConfigError, match="unknown option"):
        TraceStore.connect("redis://127.0.0.1:1", run="r", retrys=3)
    with pytest.raises(ConfigError, match="retries"):
        TraceStore.connect("redis://127.0.0.1:1", run="r", retries=-1)


def test_retry_policy_is_explicit(standalone_url: str) -> None:
    client, cluster, _ = sync_client(standalone_url, ConnectionOptions(retries=2, socket_timeout_s=3))
    try:
        kwargs: Any = client.connection_pool.connection_kwargs  # type: ignore[union-attr]
        assert kwargs["retry"].get_retries() == 2
        assert kwargs["socket_timeout"] == 3
        assert kwargs["protocol"] == 2
        assert not cluster
    finally:
        client.close()


def test_cluster_detected_from_plain_url(cluster_url: str) -> None:
    plain = cluster_url.replace("redis+cluster://", "redis://")
    with TraceStore.connect(plain, run="detect") as st:
        assert st.cluster
        assert st.server_info().mode == "cluster"


def test_env_url_is_used(standalone_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRACESTORE_URL", standalone_url)
    with TraceStore.connect(run="envrun") as st:
        assert st.url == standalone_url
        assert st.ping()


def test_password_and_acl_user_from_url() -> None:
    with EmbeddedServer(password="s3cret") as srv:
        admin = srv.client()
        admin.acl_setuser("alice", enabled=True, passwords=["+wonder"], keys=["ts:*"], commands=["+@all"])
        with pytest.raises(StorageError):
            TraceStore.connect(f"redis://127.0.0.1:{srv.port}", run="a", retries=0)
        with TraceStore.connect(f"redis://:s3cret@127.0.0.1:{srv.port}", run="a") as st:
            st.open_session("s", "o")
        with TraceStore.connect(f"redis://alice:wonder@127.0.0.1:{srv.port}", run="a") as st:
            assert st.owner_of("s") == "o"
        with pytest.raises(StorageError):
            TraceStore.connect(f"redis://alice:wrong@127.0.0.1:{srv.port}", run="a", retries=0)


def test_unix_socket_url() -> None:
    with EmbeddedServer(unix_socket=True) as srv, TraceStore.connect(srv.unix_url, run="u") as st:
        assert not st.cluster
        st.open_session("s", "o")
        assert st.owner_of("s") == "o"


def test_tls_url(tmp_path: Path) -> None:
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("TLS needs Debian's redis-server (the embedded valkey-server is built without TLS)")
    tls = TlsFiles.self_signed(tmp_path)
    with EmbeddedServer(binary=binary, tls=tls) as srv:
        assert srv.url.startswith("rediss://")
        with TraceStore.connect(srv.url, run="tls") as st:
            st.open_session("s", "o")
            assert st.owner_of("s") == "o"
        # a plain-text client cannot talk to the TLS port
        with pytest.raises(StorageError):
            TraceStore.connect(f"redis://127.0.0.1:{srv.port}", run="tls", retries=0, socket_timeout_s=1)
