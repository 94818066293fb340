"""The built-in `sim` provider: a model without a GPU (replies, a prefix cache, prefill
time, model memory), for the demo, the tests and the bench."""
