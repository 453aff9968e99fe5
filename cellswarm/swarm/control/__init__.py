"""The control plane: the coordinator, membership and placement, the node store, the job
queue and its databases, the failure policy and the settings."""
