"""The benchmark harness: IOP's overhead against a direct upstream and LiteLLM's proxy.

`python -m bench` (or `just bench`) runs it; `bench.run` documents the options. Modules:
`upstream` (the fast fake upstream), `services` (child processes), `gateway` (IOP's Edge
and Node), `litellm_proxy` (the optional LiteLLM run), `load` (closed-loop generator),
`report` (the table and the targets), `profiler` (optional py-spy profiles).
"""
