"""Runs: admission, the per-model queues and slot accounting (scheduler), and the
dispatch of a run to a Node with failover, blame and cooldown.
"""
