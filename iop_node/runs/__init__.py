"""Runs on the Node (design §3, §14): the runner, a run of each caller protocol, slots,
activity and model commands."""
