"""cellswarm: big models on swarms of small nodes."""
