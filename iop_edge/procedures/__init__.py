"""What the Edge process does over its life, each procedure in the module named after it.

- `serve`: start every part in order (the scheduler, the ledger, the node listener, the
  HTTP listeners), report the addresses, wait for a stop, then end in order.
- `drain`: the end of every stop and of every restart: accept nothing more, `goaway` to
  the Nodes, let callers finish within the grace period, cut what is left.
- `restart`: hand the sockets and the Nodes over to a successor process (design §13).
- `takeover`: the successor's side: wait (bounded) for the old Edge's Nodes.

The composition root (`iop_edge.edge`) builds the parts and calls these; they run the
http layer's servers, so they sit between the two (the "Edge layers" import contract).
"""
