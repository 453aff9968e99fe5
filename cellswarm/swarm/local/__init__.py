"""A swarm on this machine: `cellswarm up`, the demo, measurements, LocalPipeline."""
