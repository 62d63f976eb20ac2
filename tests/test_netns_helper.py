"""The namespace helper itself: traffic between the two namespaces crosses the veth."""

from __future__ import annotations

import subprocess
import sys

from tests.netns import veth_pair


def test_traffic_crosses_the_veth():
    with veth_pair("kvh") as (a, b):
        server = subprocess.Popen(
            b.cmd(
                [
                    sys.executable,
                    "-c",
                    "import socket;s=socket.socket();s.bind(('0.0.0.0',9477));s.listen();c,_=s.accept();c.recv(1<<20)",
                ]
            )
        )
        before = b.bytes_received()
        code = f"import socket,time;time.sleep(0.5);c=socket.create_connection(('{b.ip}',9477));c.sendall(b'x'*200000);c.close()"
        subprocess.run(a.cmd([sys.executable, "-c", code]), check=True, timeout=30)
        server.wait(timeout=30)
        assert b.bytes_received() - before >= 200000
