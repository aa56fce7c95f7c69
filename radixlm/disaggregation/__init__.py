"""Prefill/decode disaggregation (docs/disaggregation.md): a prefill server computes a prompt's KV
and its first token, a decode server receives that KV into its own pool and generates the rest.

Layering: above the scheduler (it acts on requests through the port, `RequestOps`, and is
called through its `TransferHooks`: `scheduler/port.py`), below srt (the scheduler process
builds it and hands it to the scheduler's constructor). Modules, one role each:
- `protocol.py`: the room key, the messages and their frames;
- `links.py`: the `Link` a side sends and receives frames on, and the ZeroMQ TCP one
  (the prefill side's bootstrap server is a ROUTER on `--disaggregation-bootstrap-port`);
- `kv_pages.py`: packing a request's KV slots into chunks and writing chunks into slots;
- `prefill_side.py`, `decode_side.py`: the two rooms state machines (the scheduler hooks);
- `build.py`: what `--disaggregation-mode` builds in the scheduler process.
"""
