"""The Python client's server address: one host:port, or the members of a replicated group
separated by commas (docs/design.md §10.1, common/server_addresses.h). Parsing and the gRPC target
as the C++ side makes them, and rebound.client.Connection over a list against real gRPC servers
on loopback: it reaches the member that listens (only the leader does), and follows the leader
to another member. Every wait bounded; every server started here is stopped."""

import socket
import time
from concurrent import futures

import grpc
import pytest

from rebound import client as rclient
from rebound_pb import rebound_pb2, rebound_pb2_grpc

BOUND_S = 15.0  # generous: a busy 2-core machine


def test_a_single_address_is_unchanged():
    assert rclient.parse_server_addresses("127.0.0.1:7070") == ["127.0.0.1:7070"]
    assert rclient.channel_target("no-such-host.invalid:7070") == "no-such-host.invalid:7070"
    assert rclient.channel_target("dns:///rebound.ns.svc:7070") == "dns:///rebound.ns.svc:7070"
    with pytest.raises(ValueError, match="server must be host:port, got '7070'"):
        rclient.Options(server="7070")


def test_a_list_is_split_in_order_without_white_space():
    assert rclient.parse_server_addresses(" 10.0.0.1:7070 , server-b:7071,[::1]:7072 ") == [
        "10.0.0.1:7070", "server-b:7071", "[::1]:7072"]
    assert rclient.Options(server="10.0.0.1:7070,10.0.0.2:7070").server == \
        "10.0.0.1:7070,10.0.0.2:7070"


@pytest.mark.parametrize("server, message", [
    ("a:1,,b:2", "server entry 2 of 'a:1,,b:2' is empty; expected host:port addresses "
                 "separated by commas"),
    ("a:1,b", "server entry 2 of 'a:1,b' must be host:port with a port in [1, 65535] (a member "
              "of the group), got 'b'"),
    ("a:0,b:1", "server entry 1 of 'a:0,b:1' must be host:port with a port in [1, 65535] (a "
                "member of the group), got 'a:0'"),
    ("a:1,dns:///b:2", "server entry 2 of 'a:1,dns:///b:2' must be host:port with one host"),
    ("a:1,::1:2", "server entry 2 of 'a:1,::1:2' must be host:port with one host"),
    ("a:1,b:2, a:1", "server entry 3 of 'a:1,b:2, a:1' repeats entry 1, 'a:1'"),
])
def test_a_bad_list_is_refused_naming_the_entry(server, message):
    with pytest.raises(ValueError) as error:
        rclient.Options(server=server)
    assert str(error.value).startswith(message)


def test_list_targets_are_resolved_once_ipv4_first():
    assert rclient.channel_target("10.0.0.2:7071, 10.0.0.1:7070") == \
        "ipv4:10.0.0.2:7071,10.0.0.1:7070"
    assert rclient.channel_target("[::1]:1,[2001:db8::7]:2") == "ipv6:[::1]:1,[2001:db8::7]:2"
    assert rclient.channel_target("127.0.0.1:1,[::1]:2") == "ipv6:[::ffff:127.0.0.1]:1,[::1]:2"
    # The test machines' /etc/hosts maps localhost to 127.0.0.1 (perhaps also to ::1).
    assert rclient.channel_target("localhost:7070,127.0.0.2:7071") == \
        "ipv4:127.0.0.1:7070,127.0.0.2:7071"
    assert rclient.channel_target("localhost:7070,127.0.0.1:7070") == "ipv4:127.0.0.1:7070"
    with pytest.raises(rclient.Unreachable, match="cannot resolve the host 'no-such-host.invalid'"):
        rclient.channel_target("127.0.0.1:7070,no-such-host.invalid:7071")


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Member(rebound_pb2_grpc.ParameterServerServicer):
    """A group member that answers GetStatus with its own name as server_version."""

    def __init__(self, name):
        self.name = name

    def GetStatus(self, request, context):
        return rebound_pb2.GetStatusResponse(server_version=self.name)


def start_member(port, name):
    # Permits the failover channel's keepalive pings, as the group's servers do.
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ])
    rebound_pb2_grpc.add_ParameterServerServicer_to_server(Member(name), server)
    assert server.add_insecure_port("127.0.0.1:%d" % port) == port
    server.start()
    return server


def time_until_answer(conn, name):
    """Seconds until GetStatus through ``conn`` answers from member ``name``; None if it does not
    within BOUND_S."""
    start = time.monotonic()
    while time.monotonic() - start < BOUND_S:
        try:
            if conn.call("GetStatus", rebound_pb2.GetStatusRequest(), deadline_s=1.0,
                         retry=False).server_version == name:
                return time.monotonic() - start
        except rclient.CallError:
            pass
        time.sleep(0.05)
    return None


def test_the_connection_reaches_the_member_that_listens_and_follows_it():
    port_a, port_b = free_port(), free_port()
    assert port_a != port_b
    servers = [start_member(port_b, "member-b")]
    conn = rclient.Connection(rclient.Options(
        server="127.0.0.1:%d,127.0.0.1:%d" % (port_a, port_b), give_up_after_s=5.0))
    try:
        first = time_until_answer(conn, "member-b")
        assert first is not None, "member B (A closed) not reached within %.0f s" % BOUND_S

        # The leader moves: B goes away, both members refuse, then A listens.
        servers.pop().stop(grace=0.5).wait()
        with pytest.raises(rclient.CallError) as refused:
            conn.call("GetStatus", rebound_pb2.GetStatusRequest(), deadline_s=1.0, retry=False)
        assert refused.value.code in (grpc.StatusCode.UNAVAILABLE,
                                      grpc.StatusCode.DEADLINE_EXCEEDED)
        servers.append(start_member(port_a, "member-a"))
        moved = time_until_answer(conn, "member-a")
        assert moved is not None, "member A not reached within %.0f s after B went away" % BOUND_S
    finally:
        conn.close()
        for server in servers:
            server.stop(grace=None)


def test_failover_options_replace_the_callers_reconnect_schedule():
    port_a, port_b = free_port(), free_port()
    servers = [start_member(port_b, "member-b")]
    # A caller's slow reconnect schedule: kept, the move below would take 20 s or more.
    channel = rclient.open_channel("127.0.0.1:%d,127.0.0.1:%d" % (port_a, port_b), options=[
        ("grpc.initial_reconnect_backoff_ms", 20000),
        ("grpc.min_reconnect_backoff_ms", 20000),
        ("grpc.max_reconnect_backoff_ms", 60000),
    ])
    stub = rebound_pb2_grpc.ParameterServerStub(channel)

    def answer():
        try:
            return stub.GetStatus(rebound_pb2.GetStatusRequest(), timeout=1.0).server_version
        except grpc.RpcError:
            return None

    def time_until(name):
        start = time.monotonic()
        while time.monotonic() - start < BOUND_S:
            if answer() == name:
                return time.monotonic() - start
            time.sleep(0.05)
        return None

    try:
        assert time_until("member-b") is not None
        servers.pop().stop(grace=0.5).wait()
        assert answer() is None  # both members refuse: the channel is in its reconnect backoff
        servers.append(start_member(port_a, "member-a"))
        moved = time_until("member-a")
        assert moved is not None, "member A not reached within %.0f s after B went away" % BOUND_S
    finally:
        channel.close()
        for server in servers:
            server.stop(grace=None)
