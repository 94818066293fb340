"""The benchmark harness: IOP's overhead and cost against a direct upstream and its peers.

`python -m bench` (or `just bench`) runs it; `bench.run` documents the options. Modules:
`upstream` (the fast fake upstream, paced on demand; its Messages and Responses answers
in `upstream_protocols`, its prompt prefix-cache model in `prefix_cache`), `services`
(child processes), `gateway` (IOP's Edge and Node), `litellm_proxy` and `vllm_router`
(the optional peers), `load` (closed-loop generator), `fleet` (fleet-shaped streams),
`many_nodes` and `light_nodes` (a thousand Nodes on one Edge), `many_tokens` (ten
thousand caller tokens: startup, and a refresh's hold on callers), `agent_cache` (Claude
Code's attribution block against a prefix cache), `procfs` (the processes' own CPU and
memory counters), `result`, `targets` and `report` (the numbers, the performance goals, the
tables), `profiler` (optional py-spy profiles).
"""
