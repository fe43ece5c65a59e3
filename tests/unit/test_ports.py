"""deploy.servers.free_ports: the launcher's port choice must not race outgoing connections."""
import socket

from deploy import servers


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    lo, _ = servers.ephemeral_port_range()
    ports = servers.free_ports(40)
    assert len(set(ports)) == 40
    assert all(1024 <= p < lo for p in ports), (lo, ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # still free: nothing in the range is handed out implicitly


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
