"""What travels between the executor and worker processes.

The step's SchedulerOutput is encoded once per step as msgpack (msgspec, typed: it decodes back into the same
dataclasses) and the same bytes go to every rank; the driver's ModelRunnerOutput comes back the same way. The rare
start-up and maintenance calls (collective_rpc) are pickled: they carry arbitrary arguments between processes of
the same engine, never anything from a client.
"""

from __future__ import annotations

import msgspec

from kvserve.core.sched_output import SchedulerOutput
from kvserve.outputs import ModelRunnerOutput

STEP = b"step"
RPC = b"rpc"
STOP = b"stop"
OK = b"ok"
ERR = b"err"

encoder = msgspec.msgpack.Encoder()
step_decoder = msgspec.msgpack.Decoder(SchedulerOutput)
# None: async scheduling's first step has no output yet.
output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput | None)
