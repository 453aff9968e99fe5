"""The planner: will a model run on N nodes of a kind, how fast, at what power."""
