"""The swarm: stages that each hold a shard and stream activations to each other."""
