"""The benchmark harness: IOP's overhead and cost against a direct upstream and its peers.

`python -m bench` (or `just bench`) runs it; `bench.run` documents the options. Modules:
`upstream` (the fast fake upstream, paced on demand), `services` (child processes),
`gateway` (IOP's Edge and Node), `litellm_proxy` and `vllm_router` (the optional peers),
`load` (closed-loop generator), `fleet` (fleet-shaped streams), `many_nodes` and
`light_nodes` (a thousand Nodes on one Edge), `procfs` (the processes' own CPU and memory
counters), `result`, `targets` and `report` (the numbers, the issue's goals, the tables),
`profiler` (optional py-spy profiles).
"""
