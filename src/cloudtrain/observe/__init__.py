"""Observation: experiment tracking, monitoring and anomalies, FLOPs and MFU, compute cost, plots."""
