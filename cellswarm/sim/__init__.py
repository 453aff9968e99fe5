"""`cellswarm simulate`: a discrete-event simulation of a planned swarm over hours or days.

params.py   Scenario (model, nodes, workload, failures, network) and SimParams (calibration)
model.py    a replica's timing from the planner's cost model (+ slow nodes, overheads)
network.py  per-tier link load of the live replicas (planner's flows), the slowdown
engine.py   the event loop: replicas, pull-mode queue, failures, spares, power
run.py      plan -> simulate -> JSON-ready summary
scenario.py scenario TOML files (examples/*.toml)
report.py   rich table and matplotlib charts
local.py    predict_local(): a local one-replica swarm, for calibration
cli.py      the `simulate` subcommand
"""
