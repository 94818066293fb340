"""The contract both IOP processes share: config, runtime wire, OpenAI bodies, catalog records.

Anything the Edge and a Node must agree on is defined here exactly once.
"""
