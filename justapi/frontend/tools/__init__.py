"""Tool calling in the frontend: the call format a chat template speaks (formats.py), tool
definitions and tool_choice as checked requests (request.py), messages and tools prepared for
the template (render.py), the grammar that constrains calls (grammar.py) and the parser that
turns generated text into OpenAI `tool_calls`, whole or streamed (parser.py).
"""
