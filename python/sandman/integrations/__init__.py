"""Adapters for agent harnesses: `mini_swe_agent` (needs `pip install sandman-sdk[mini-swe-agent]`)."""
