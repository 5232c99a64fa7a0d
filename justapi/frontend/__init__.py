"""The frontend process: HTTP (OpenAI-compatible) and ZMQ client sessions, tokenizer, chat
templates, incremental detokenization and stop strings, over the EngineClient link to the
scheduler. Entry points: `server.build_serving` + `server.FrontendServer` (what the process
shell runs), `api_server.build_app` (the FastAPI app) and `zmq_server.ZmqServer`.
"""
