"""The Edge process's life: its listening sockets, the replica roster, and the
zero-downtime handover to a successor process.
"""
