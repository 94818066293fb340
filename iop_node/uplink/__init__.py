"""The Node's outbound link to its Edges (design §3): dialing with backoff, the websocket
session, its settings, and the batching of what goes up."""
