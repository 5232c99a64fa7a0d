"""/v1/responses (OpenAI's Responses API, served stateless): the request (models.py),
translated into a chat request (translate.py), and the reply as output items, whole or as the
documented stream of events (output.py).
"""
