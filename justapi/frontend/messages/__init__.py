"""Anthropic's /v1/messages and /v1/messages/count_tokens: the request (models.py), translated
into a chat request (translate.py), and the reply as content blocks, whole or as Anthropic's
stream of events (output.py).
"""
