"""Config refresh: validation of a candidate, the plan, pushes to Nodes and acks, and the
audit trail with the atomic config write.
"""
