"""Clients of the served ``ranker`` ensemble."""
