"""IOP Edge: the single front door (OpenAI API, node websocket, admin API)."""
