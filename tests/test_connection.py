"""Connection URLs, auth, TLS, unix sockets, cluster detection, retry policy."""

from __future__ import annotations

from collections.abc import Iterator
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


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[EmbeddedServer, TlsFiles]]:
    """A TLS server (Debian's redis-server) with a self-signed certificate."""
    binary = redis_server_binary()
    if binary is None:
        pytest.skip("TLS needs Debian's redis-server (the embedded valkey-server is built without TLS)")
    tls = TlsFiles.self_signed(tmp_path)
    with EmbeddedServer(binary=binary, tls=tls) as srv:
        yield srv, tls


def test_tls_url(tls_server: tuple[EmbeddedServer, TlsFiles]) -> None:
    srv, _ = tls_server
    assert srv.url.startswith("rediss://")
    with TraceStore.connect(srv.url, run="tls") as st:
        st.open_session("s", "o")
        assert st.owner_of("s") == "o"
    # a plain-text client cannot talk to the TLS port
    with pytest.raises(StorageError):
        TraceStore.connect(f"redis://127.0.0.1:{srv.port}", run="tls", retries=0, socket_timeout_s=1)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("decode_responses=yes", "'decode_responses' is not accepted"),
        ("protocol=3", "'protocol' is not accepted"),
        ("socket_timeout=abc", "'socket_timeout' is not accepted.*socket_timeout_s"),
        ("retry_on_timeout=1", "not accepted"),
        ("ssl_ca_certs=/ca.pem", "needs a TLS URL"),
        ("db=x", "db must be a database number"),
        ("db=1&db=2", "given twice"),
    ],
)
def test_url_options_that_would_break_the_client_are_refused(query: str, message: str) -> None:
    # port 1: any I/O would be a StorageError, so a ConfigError proves the check runs first
    with pytest.raises(ConfigError, match=message):
        TraceStore.connect(f"redis://127.0.0.1:1/?{query}", run="r")
    with pytest.raises(ConfigError, match="ssl_cert_reqs must be one of"):
        TraceStore.connect("rediss://127.0.0.1:1?ssl_cert_reqs=maybe", run="r")


@pytest.mark.parametrize(
    "option",
    [
        {"socket_timeout_s": float("nan")},
        {"socket_timeout_s": float("inf")},
        {"socket_timeout_s": 10**400},
        {"socket_timeout_s": "5"},
        {"connect_timeout_s": 0},
        {"retries": 1.5},
        {"retries": True},
        {"max_connections": 0},
        {"health_check_interval_s": -1},
        {"client_name": "has space"},
        {"backoff_base_s": float("nan")},
        {"op_ttl_s": 0},
        {"op_ttl_s": 10**400},
        {"store_text": "yes"},
        {"cache_bytes": -1},
        {"max_payload_bytes": 2.5},
        {"ssl_cert_reqs": "maybe"},
        {"ssl_check_hostname": "no"},
        {"ssl_ca_certs": 7},
    ],
)
def test_every_option_is_checked_before_io(option: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=next(iter(option))):
        TraceStore.connect("rediss://127.0.0.1:1", run="r", **option)


def test_tls_options_as_connect_keywords(tls_server: tuple[EmbeddedServer, TlsFiles], tmp_path: Path) -> None:
    srv, tls = tls_server
    bare = f"rediss://127.0.0.1:{srv.port}"
    with TraceStore.connect(bare, run="tls", ssl_ca_certs=str(tls.ca)) as st:
        st.open_session("s", "o")
    with TraceStore.connect(bare, run="tls", ssl_cert_reqs="none") as st:
        assert st.owner_of("s") == "o"
    with pytest.raises(StorageError, match="cannot reach") as ei:  # no CA: the certificate is not trusted
        TraceStore.connect(bare, run="tls", retries=0)
    assert "\n" not in str(ei.value)
    with pytest.raises(ConfigError, match="keyword .* and in the URL"):
        TraceStore.connect(srv.url, run="tls", ssl_ca_certs=str(tmp_path / "other.pem"))
    with pytest.raises(ConfigError, match="need a TLS URL"):
        TraceStore.connect(f"redis://127.0.0.1:{srv.port}", run="tls", ssl_ca_certs=str(tls.ca))
    # the cluster scheme on a node that is not in cluster mode: one line that says so
    with pytest.raises(ConfigError, match="not a cluster node") as ei2:
        TraceStore.connect(bare.replace("rediss://", "rediss+cluster://"), run="tls", ssl_ca_certs=str(tls.ca))
    assert "\n" not in str(ei2.value) and "rediss://" in str(ei2.value)


def test_cluster_scheme_on_a_standalone_node_is_one_line(standalone_url: str, arun: Any) -> None:
    from tracestore import AsyncTraceStore

    url = standalone_url.replace("redis://", "redis+cluster://")
    with pytest.raises(ConfigError, match="not a cluster node") as ei:
        TraceStore.connect(url, run="r")
    assert "\n" not in str(ei.value)

    async def main() -> None:
        with pytest.raises(ConfigError, match="not a cluster node"):
            await AsyncTraceStore.connect(url, run="r")

    arun(main())


def test_cluster_url_with_several_seeds_parses_and_checks_each() -> None:
    p = parse_url("redis+cluster://u:secret@h1:7001,h2:7002,[::1]:7003/0")
    assert p.cluster is True and p.url == "redis://u:secret@h1:7001/0"
    assert p.seeds == (("h1", 7001), ("h2", 7002), ("::1", 7003))
    assert "secret" not in p.display and "h2:7002" in p.display
    assert parse_url("redis+cluster://h1:7001").seeds == ()
    for bad, message in [
        ("redis://h1:1,h2:2", "several hosts; only a cluster URL"),
        ("rediss://h1:1,h2:2", "several hosts"),
        ("redis+cluster://h1:1,,h2:2", "empty seed"),
        ("redis+cluster://h1:1,h2:99999", "(?i)port"),
    ]:
        with pytest.raises(ConfigError, match=message):
            parse_url(bad)


def test_any_live_seed_is_enough_and_none_is_one_storage_error(cluster_url: str, arun: Any) -> None:
    from tests.conftest import connect_async
    from tracestore.servers import free_port

    live = cluster_url.split("://", 1)[1]
    dead = [f"127.0.0.1:{free_port()}" for _ in range(2)]
    url = f"redis+cluster://{dead[0]},{dead[1]},{live}"
    with TraceStore.connect(url, run="seeds") as st:
        st.open_session("s", "o")
        assert st.cluster and st.owner_of("s") == "o"

    async def main() -> None:
        a = await connect_async(url, "seeds")
        try:
            assert await a.owner_of("s") == "o"
        finally:
            await a.close()
        with pytest.raises(StorageError, match="cannot reach any seed of") as err:
            await connect_async(f"redis+cluster://{dead[0]},{dead[1]}", "seeds")
        assert "\n" not in str(err.value)

    arun(main())
    for bad in (f"redis+cluster://{dead[0]},{dead[1]}", f"redis+cluster://{dead[0]}"):
        with pytest.raises(StorageError, match="cannot reach") as err:
            TraceStore.connect(bad, run="seeds", retries=0)
        assert "\n" not in str(err.value) and not isinstance(err.value.__cause__, StorageError)


def test_short_default_timeouts(standalone_url: str) -> None:
    """Short commands time out after 1 s (a hung node costs its failover plus about a second)."""
    opts = ConnectionOptions()
    assert (opts.socket_timeout_s, opts.connect_timeout_s) == (1.0, 2.0)
    client, _, _ = sync_client(standalone_url)
    try:
        kwargs: Any = client.connection_pool.connection_kwargs  # type: ignore[union-attr]
        assert kwargs["socket_timeout"] == 1.0 and kwargs["socket_keepalive"] is True
    finally:
        client.close()


@pytest.mark.parametrize(
    "args",
    [
        ("SET", "k", "v"),
        ("SET", b"k", 1, 2.5, "é"),
        ("CONFIG RESETSTAT",),  # a two-word name: redis-py splits it
        (b"CLIENT SETINFO", "LIB-NAME", "x"),
        ("GET", bytearray(b"k")),  # hiredis refuses these: redis-py's packer converts them
        ("SET", memoryview(b"k"), b"v"),
        ("GET", "a b"),  # a space in an argument is not a word break
        (" GET", "k"),  # a str name is stripped and split at any whitespace...
        ("GET\t", "k"),
        (b"GET\t", "k"),  # ...a bytes one only at spaces
        (memoryview(b"GET"), "k"),
    ],
)
def test_the_fast_packer_writes_what_redis_py_writes(args: tuple[Any, ...]) -> None:
    from redis.connection import HiredisRespSerializer

    from tracestore.connection import FastPacker

    assert FastPacker().pack(*args) == HiredisRespSerializer().pack(*args)


def test_a_standalone_client_packs_with_the_fast_packer(standalone_url: str) -> None:
    """A command of tens of thousands of arguments (a release's purge) goes out in one hiredis call."""
    from tracestore.connection import FastPacker

    client, cluster, _ = sync_client(standalone_url)
    try:
        assert not cluster
        assert isinstance(client.connection_pool.connection_kwargs["command_packer"], FastPacker)
        keys = [f"fastpack:{i}" for i in range(20_000)]
        assert client.execute_command("MSET", *(x for k in keys for x in (k, k))) is True
        assert client.execute_command("CONFIG RESETSTAT") is True
        assert client.execute_command("UNLINK", *keys) == 20_000
    finally:
        client.close()
