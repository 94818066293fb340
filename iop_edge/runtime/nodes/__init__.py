"""The Nodes' side of the Edge: the websocket listener, handshakes, one session per
connected Node (its heartbeat and frames) and the hub that knows them all.
"""
