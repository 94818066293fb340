"""Routing, pure: the pool's decisions (design §4), affinity and the prefix index, model
placement and holdings (design §18), blame, readiness and the fair queue's unit of work."""
