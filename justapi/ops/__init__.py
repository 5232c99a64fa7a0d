"""The ops commands of `justapi` (status, health, drain, flush-cache: a running server's admin
socket; keys, inspect, perplexity: no server needed), their shared plumbing (admin_cli.py) and
the admin client (admin_client.py), and the per-step timelines every process records when
JUSTAPI_TIMELINE is set (timeline.py). justapi/cli.py registers the commands.
"""
