"""Reasoning models in the frontend: the thinking markers a chat template's model writes
(formats.py), a reply split into its thinking and its answer as it streams (splitter.py), and a
request's thinking switches for the template and its constraint (request.py).
"""
