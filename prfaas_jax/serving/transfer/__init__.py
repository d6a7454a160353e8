"""The state transfer: how a request's state gets from the prefill worker that made it to the
decode worker that decodes it (paper §3.3). The contract is `api.py`; the workers call it.

| module | holds |
|---|---|
| `api.py` | `StateSender`, `StateReceiver`, the `TransferPhase` table, the errors |
| `sender.py` | `StatePush`: one transfer from a prefill worker (the sender) |
| `receiver.py` | `PushIntake` / `IncomingPush`: a decode worker's pushes (the receiver) |
| `outbox.py` | frames between the engine thread and the streams, shaped by the link |
| `stripes.py` | one transfer over several streams, gathered at the receiver |
| `channels.py` | the gRPC channels and data connections a prefill worker pushes on |
| `data_path.py` | a push's frames on a TCP connection of its own beside `PushState` |
| `state_chunks.py` | `PushState`'s messages without protobuf's copies of their frames |
| `push_reader.py`, `push_decoder.py` | a push's frames read and timed, and decoded as they arrive |
| `increments.py` | the received KV a decode worker keeps, so a state can ship as an increment |
| `faults.py` | fault injection in transfers (`[faults]`): corrupt frames, cut links, blank states |
"""
