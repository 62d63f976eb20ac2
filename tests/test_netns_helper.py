"""The namespace helper itself: traffic between the two namespaces crosses the veth."""

from __future__ import annotations

import subprocess
import sys

from tests.netns import veth_pair

SERVER = """
import socket
s = socket.socket()
s.bind(("0.0.0.0", 9477))
s.listen()
c, _ = s.accept()
while c.recv(1 << 20):
    pass
"""

CLIENT = """
import socket, sys, time
time.sleep(0.5)
c = socket.create_connection((sys.argv[1], 9477))
c.sendall(b"x" * 200000)
c.close()
"""


def test_traffic_crosses_the_veth():
    with veth_pair("kvh") as (a, b):
        server = subprocess.Popen(b.cmd([sys.executable, "-c", SERVER]))
        before = b.bytes_received()
        subprocess.run(a.cmd([sys.executable, "-c", CLIENT, b.ip]), check=True, timeout=30)
        server.wait(timeout=30)
        assert b.bytes_received() - before >= 200000
