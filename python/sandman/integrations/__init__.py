"""Adapters for agent harnesses, each imported only when used (their packages are optional):
`mini_swe_agent` (`pip install sandman-sdk[mini-swe-agent]`), `harbor` (Harbor's environment,
`sandman-sdk[harbor]`, Python 3.12+) and `swerex` (SWE-ReX's deployment and runtime,
`sandman-sdk[swe-rex]`)."""
