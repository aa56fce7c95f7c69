"""Many engine replicas behind one HTTP front: `radixlm serve --dp-size N`.

- `replicas`: N `radixlm serve` processes on loopback, the CPU cores split between them.
- `gateway`: the SGLang Model Gateway (`smg`, a separate Rust binary) in front of them.
- `dispatcher`: radixlm's small built-in router, for machines without `smg`.
- `launch`: the supervisor that starts, watches and stops all of it.

docs/fleet.md describes the contract a gateway relies on (what smg calls on a worker).
"""
