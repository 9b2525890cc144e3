"""Kubernetes API access shared by discovery and leader election."""
