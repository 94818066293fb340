"""IOP Node: dials out to the Edge and executes runs through provider adapters."""

__version__ = "0.1.0"
