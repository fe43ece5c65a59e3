"""The launcher's ports: deploy.servers.free_ports must not race outgoing connections, and a
published port another process holds is refused before anything starts."""
import socket

import pytest

from common.topology import ClusterLayout
from deploy import launcher, servers


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    lo, _ = servers.ephemeral_port_range()
    ports = servers.free_ports(40)
    assert len(set(ports)) == 40
    assert all(1024 <= p < lo for p in ports), (lo, ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: nothing in the range is handed out implicitly


def test_knot_ports_bounds_the_pool(monkeypatch):
    """Two processes handing out ports at once (scripts/test.sh --lanes) each draw from their own."""
    monkeypatch.setenv("KNOT_PORTS", "27100-27199")
    ports = servers.free_ports(30)
    assert len(set(ports)) == 30 and all(27100 <= p <= 27199 for p in ports), ports
    assert servers.port_pool()[1] == "KNOT_PORTS 27100-27199"


@pytest.mark.parametrize("raw", ["27100", "27199-27100", "80-90", "a-b", "27100-70000"])
def test_a_bad_knot_ports_is_refused_naming_it(monkeypatch, raw):
    from common.settings import ConfigError

    monkeypatch.setenv("KNOT_PORTS", raw)
    with pytest.raises(ConfigError, match="KNOT_PORTS") as e:
        servers.free_ports(1)
    assert e.value.name == "KNOT_PORTS"


def test_a_pool_too_small_is_an_error_naming_it(monkeypatch):
    monkeypatch.setenv("KNOT_PORTS", "27300-27301")
    with pytest.raises(servers.ServerError, match="KNOT_PORTS 27300-27301"):
        servers.free_ports(3)


def test_free_ports_never_repeats_within_a_process():
    a, b = servers.free_ports(30), servers.free_ports(30)
    assert not set(a) & set(b)


def test_outgoing_connections_do_not_land_on_chosen_ports():
    # The CI failure mode: many client sockets (boto3, redis) take local ports from the
    # ephemeral range. None of them may collide with a port free_ports handed out.
    chosen = set(servers.free_ports(20))
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(256)
        clients = []
        try:
            for _ in range(200):
                c = socket.create_connection(srv.getsockname())
                clients.append(c)
                assert c.getsockname()[1] not in chosen
        finally:
            for c in clients:
                c.close()


def test_up_refuses_a_published_port_another_process_holds(tmp_path):
    """Otherwise the coordinator exits on EADDRINUSE while the other process answers its probe."""
    layout = ClusterLayout.build({"block_count": 2, "vocab_size": 64}, 1, 1)
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        specs = launcher.plan(layout, {"KNOT_PORT": str(port), "KNOT_REDIS_PASSWORD": "generated", "KNOT_INTERNAL_SECRET": "k" * 43,
                                       "MINIO_ROOT_USER": "bucket-key", "MINIO_ROOT_PASSWORD": "bucket-secret-key"})
        with pytest.raises(launcher.LauncherError, match=f"port {port} .*in use.*KNOT_PORT"):
            launcher.Cluster(tmp_path).allocate(specs, None)
    assert launcher.Cluster(tmp_path).allocate(specs, None)["coordinator"][1] == port  # free again
