"""The wire between processes: message dataclasses, the orjson + numpy frame codec, ZeroMQ sockets, CURVE keys."""
