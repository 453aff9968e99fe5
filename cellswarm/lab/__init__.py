"""`cellswarm lab`: a swarm of real hosts (network namespaces) on one Linux machine."""
