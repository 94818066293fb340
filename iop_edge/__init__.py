"""IOP Edge: the single front door (OpenAI API, node websocket, admin API)."""

__version__ = "0.1.0"
