"""A worker node: joining, heartbeats, the head that leases jobs, shard fetching, addresses."""
