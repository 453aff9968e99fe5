"""How nodes and the coordinator reach each other, used by both ends: sealed heartbeats over
NATS (beats), log batches (logship), a shard's chunks and their manifest (fetch), and the
checks every number on the wire passes (wire). Below control and node; imports only
protocol, policy, auth and tls from the swarm."""
