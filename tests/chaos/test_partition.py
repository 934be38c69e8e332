"""The soak's partitions (``tests.cluster.network.cut`` / ``mend``) in real network namespaces: an open connection
stalls without a reset and carries its held bytes once mended; a new one fails while cut. Skipped where namespaces
cannot be made (not root), as ``bench.chaos`` then skips its partition faults with the same reason."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.cluster.network import Network, cut, mend, netns_unavailable, open_network, partition_unavailable

# In host a: connect to b's echo, send, read; then (cut by the test) send again and see nothing; then read once mended.
_CLIENT = """
import socket, sys
address = (sys.argv[1], 9000)
c = socket.create_connection(address, timeout=5)
c.sendall(b"one"); assert c.recv(10) == b"one"
print("connected", flush=True)
sys.stdin.readline()                      # the test cuts the hosts apart
c.settimeout(1.5); c.sendall(b"two")
try:
    c.recv(10); print("answered while cut", flush=True)
except TimeoutError:
    print("stalled", flush=True)
try:
    socket.create_connection(address, timeout=5); print("new connection while cut", flush=True)
except OSError as error:
    print("refused", type(error).__name__, flush=True)
sys.stdin.readline()                      # the test mends the partition
c.settimeout(10); print("held", c.recv(10).decode(), flush=True)
"""
_ECHO = """
import socket, sys, threading
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 9000)); s.listen()
print("listening", flush=True)
def serve(c):
    while data := c.recv(100):
        c.sendall(data)
while True:
    threading.Thread(target=serve, args=(s.accept()[0],), daemon=True).start()
"""


def _host(network: Network, name: str, code: str, arg: str) -> subprocess.Popen[str]:
    argv = network.hosts[name].argv([sys.executable, "-c", code, arg])
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    return process.stdout.readline().strip()


@pytest.mark.skipif(netns_unavailable() is not None, reason=f"no network namespaces: {netns_unavailable()}")
def test_a_partition_stalls_open_connections_refuses_new_ones_and_mends() -> None:
    with open_network(("a", "b")) as network:
        assert partition_unavailable(network) is None
        echo = _host(network, "b", _ECHO, network["b"].address)
        client = None
        try:
            assert _line(echo) == "listening"
            client = _host(network, "a", _CLIENT, network["b"].address)
            assert _line(client) == "connected"
            cut(network, "a", "b")
            assert client.stdin is not None
            client.stdin.write("\n")
            client.stdin.flush()
            assert _line(client) == "stalled"
            assert _line(client).startswith("refused")
            mend(network, "a", "b")
            client.stdin.write("\n")
            client.stdin.flush()
            assert _line(client) == "held two"
            assert client.wait(timeout=10) == 0
        finally:
            mend(network, "a", "b")
            for process in (client, echo):
                if process is None:
                    continue
                process.kill()
                process.wait(timeout=10)


def test_partitions_say_why_they_cannot_run_on_loopback() -> None:
    reason = partition_unavailable(Network("loopback", {}, reason="not root"))
    assert reason == "hosts are not in network namespaces (not root)"
